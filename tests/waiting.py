"""Waiting on a condition with a deadline: what tests use instead of sleeping for "long enough".

A sleep that waits for something to happen is either too long (a slow suite) or too short (a flaky
one). Poll the observable condition instead and fail, naming what never happened, at the deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = POLL_S) -> None:
    """Return once ``predicate()`` is truthy; AssertionError naming ``what`` after ``timeout_s``. ``poll_s``: a
    longer period for a costly predicate (reading a growing log file)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


async def async_wait_until(predicate: Callable[[], object | Awaitable[object]], timeout_s: float, what: str) -> None:
    """``wait_until`` inside an event loop; ``predicate`` may be sync or return an awaitable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(POLL_S)
