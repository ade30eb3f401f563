"""`LeaseSignal`: wakes the controller's held LeaseRows calls when rows may have become leasable.

A gateway with nothing to do asks for rows with `LeaseRowsRequest.wait_s`: instead of answering "none, retry in
0.2 s", the controller holds the call until the gate opens, rows are requeued or the run ends (`notify`), then
leases again. In a synchronous run that turns the gap between a step's weight push and the next rollouts from a
poll interval into a wake-up. Waiters also re-check on their own (the servicer's LEASE_RECHECK_S, the gateways' old
poll interval), so a change nobody notified (a replica coming back) is seen as soon as before.
"""

from __future__ import annotations

import asyncio


class LeaseSignal:
    """One-shot wake-ups for every current waiter."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()
        self.notifications = 0

    @property
    def waiting(self) -> int:
        """How many callers wait now (what a test waits on before it changes what they wait for)."""
        return len(self._waiters)

    def notify(self) -> None:
        """Something that may make rows leasable changed: wake every waiter."""
        self.notifications += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(True)
        self._waiters.clear()

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the next `notify` up to `timeout_s`; True if notified. A plain future and a timer, so a waiter
        runs on the loop's next turn after `notify` (no inner task to wake first)."""
        if not timeout_s > 0:
            return False
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.add(waiter)
        timer = loop.call_later(timeout_s, lambda: waiter.done() or waiter.set_result(False))
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiters.discard(waiter)

    @staticmethod
    async def yield_to_waiters() -> None:
        """Let woken waiters answer before the caller goes on with synchronous work (a few loop turns)."""
        for _ in range(3):
            await asyncio.sleep(0)
