"""Liveness you can see: while a call to a peer is outstanding and the peer has gone silent, a warning every few
seconds naming the peer, the call and how long it has been silent.

`OverdueCall` is the rule (pure, fed a clock's readings): it warns once the peer's Status polls have gone unanswered
for `quiet_s` while the call is out, then every `every_s`. `watch_call` runs it beside an awaited call: a watchdog
task wakes at each `tick()` (a sleep of `every_s` in service; a test's event), asks the rule, and logs on this module's
logger, `fleetrl.controller.liveness`, whose WARNING lines `fleetrl up` copies from controller.log to its console
(fleetrl.up.console.LogFollower). `SilentLeaseHolders` is the same rule for a gateway that holds leased rows and
has stopped heartbeating.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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


@dataclass
class SilentLeaseHolders:
    """Gateways that hold leased rows and have stopped heartbeating: a warning once one has been silent `quiet_s`,
    then every `every_s` while it holds rows and stays silent (pure: `check` is fed the clock's reading and, per
    gateway holding rows, its seconds of silence, the rows it holds and the soonest lease deadline)."""

    quiet_s: float
    every_s: float
    _last: dict[str, float] = field(default_factory=dict)

    def check(self, now: float, holders: dict[str, tuple[float, list[int], float]]) -> list[str]:
        out = []
        for gateway_id in set(self._last) - set(holders):
            del self._last[gateway_id]
        for gateway_id, (silent_s, rows, deadline) in sorted(holders.items()):
            if silent_s < self.quiet_s:
                self._last.pop(gateway_id, None)
                continue
            last = self._last.get(gateway_id)
            if last is not None and now - last < self.every_s:
                continue
            self._last[gateway_id] = now
            shown = ", ".join(map(str, sorted(rows)[:10])) + (f" (+{len(rows) - 10} more)" if len(rows) > 10 else "")
            out.append(
                f"gateway {gateway_id} holds {len(rows)} leased rows [{shown}] and has not sent a heartbeat for "
                f"{silent_s:.0f} s (stopped, hung or cut off?); its rows go back to the queue when it misses "
                f"heartbeat_timeout_s, or in {max(deadline - now, 0):.0f} s when the first lease expires"
            )
        return out


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
