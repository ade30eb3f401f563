"""`LeaseSignal`: wakes the controller's held LeaseRows calls when rows may have become leasable.

A gateway with nothing to do asks for rows with `LeaseRowsRequest.wait_s`: instead of answering "none, retry in
0.2 s", the controller holds the call until the gate opens, rows are requeued or the run ends (`notify`), then
leases again. In a synchronous run that turns the gap between a step's weight push and the next rollouts from a
poll interval into a wake-up. Waiters also re-check every `recheck_s`, so a change nobody notified (a lease
expiring, a replica coming back) is seen within that, as before.
"""

from __future__ import annotations

import asyncio


class LeaseSignal:
    """One-shot wake-ups for every current waiter (a fresh event per notification)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.notifications = 0

    def notify(self) -> None:
        """Something that may make rows leasable changed: wake every waiter."""
        self.notifications += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the next `notify` up to `timeout_s`; True if notified."""
        if timeout_s <= 0:
            return False
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
