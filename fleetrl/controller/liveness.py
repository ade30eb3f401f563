"""Liveness you can see: while a call to a peer is outstanding and the peer has gone silent, a warning every few
seconds naming the peer, the call and how long it has been silent.

`OverdueCall` is the rule (pure, fed a clock's readings): it warns once the peer's Status polls have gone unanswered
for `quiet_s` while the call is out, then every `every_s`. `watch_call` runs it beside an awaited call: a watchdog
task wakes at each `tick()` (a sleep of `every_s` in service; a test's event), asks the rule, and logs on this module's
logger, `fleetrl.controller.liveness`, whose WARNING lines `fleetrl up` copies from controller.log to its console
(fleetrl.up.console.LogFollower).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class OverdueCall:
    """`what` (e.g. "TrainStep(step 7)") sent to `peer` (e.g. "the trainer at 127.0.0.1:5000") at `started`."""

    what: str
    peer: str
    started: float
    quiet_s: float
    every_s: float
    warnings: int = 0
    _last: float | None = None

    def __post_init__(self) -> None:
        if self.quiet_s <= 0 or self.every_s <= 0:
            raise ValueError(f"quiet_s and every_s must be > 0, got {self.quiet_s} and {self.every_s}")

    def due(self, now: float, silent_s: float) -> str | None:
        """The warning to log now (None: none), `silent_s` being how long the peer has not answered Status."""
        if silent_s < self.quiet_s:
            self._last = None  # it answers Status: a long call, not a silent peer
            return None
        if self._last is not None and now - self._last < self.every_s:
            return None
        self._last = now
        self.warnings += 1
        return (
            f"{self.what} to {self.peer}: no reply after {now - self.started:.0f} s, and it has not answered Status "
            f"for {silent_s:.0f} s (stopped, swapping or hung?); still waiting"
        )


async def watch_call(
    call: Awaitable[T],
    rule: OverdueCall,
    *,
    clock: Callable[[], float],
    silent_s: Callable[[], float],
    tick: Callable[[], Awaitable[object]],
) -> T:
    """`await call`, with `rule` asked after every `tick()` while it is outstanding (its warnings logged)."""

    async def watchdog() -> None:
        while True:
            await tick()
            message = rule.due(clock(), silent_s())
            if message is not None:
                log.warning("%s", message)

    dog = asyncio.create_task(watchdog(), name=f"watch {rule.what}")
    try:
        return await call
    finally:
        dog.cancel()
        await asyncio.gather(dog, return_exceptions=True)
