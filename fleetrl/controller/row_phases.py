"""Where a step's rows spent their time on the gateways: each accepted row's report carries the seconds of its
phases (`lease`, `rollouts`, `send`); a step's line gets their means over the rows it trained, as
`perf/lease_time`, `perf/rollout_time` and `perf/group_send_time`. Pure: the controller's servicer records, the
orchestrator asks for a step's figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# phase name in a RowReport -> the step line's metric
PHASE_METRICS = {"lease": "perf/lease_time", "rollouts": "perf/rollout_time", "send": "perf/group_send_time"}
MAX_PHASE_S = 86_400.0  # a figure past a day is not a measurement: ignored
MAX_ROWS = 65_536  # rows accepted but never trained (superseded, stale) are forgotten oldest first past this


class RowPhases:
    """Seconds per phase of each row reported accepted and not yet trained (one entry per row id: a retried
    row's last report wins). Forged or broken figures (unknown names, negative, not finite, absurdly large) are
    ignored: they cannot invent metrics."""

    def __init__(self) -> None:
        self._rows: dict[int, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, row_id: int, phase_s: Mapping[str, float]) -> None:
        kept = {
            name: float(s)
            for name, s in phase_s.items()
            if name in PHASE_METRICS and math.isfinite(s) and 0.0 <= s <= MAX_PHASE_S
        }
        if kept:
            self._rows.pop(int(row_id), None)
            self._rows[int(row_id)] = kept
            while len(self._rows) > MAX_ROWS:
                del self._rows[next(iter(self._rows))]

    def take_step(self, row_ids: Iterable[int]) -> dict[str, float]:
        """The means of each phase over the step's rows that reported it; those rows are forgotten."""
        sums: dict[str, list[float]] = {}
        for row_id in row_ids:
            for name, seconds in self._rows.pop(int(row_id), {}).items():
                sums.setdefault(name, []).append(seconds)
        return {PHASE_METRICS[name]: sum(v) / len(v) for name, v in sums.items()}
