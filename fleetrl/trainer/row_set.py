"""`RowIdSet`: the rows a trainer has trained, as sorted disjoint ranges, with a bounded size.

Rows are handed out in ascending id order (`row_id = epoch * rows + index`) and trained in nearly that order, so
the trained ids collapse into a few ranges: a range ends only where a row was rejected or failed (never trained)
or is still in flight. Memory and the checkpoint grow with those gaps, not with the rows of the run (a set of ints
grew by one entry per row and was re-sorted and saved whole at every step).

The gaps are bounded too: past `max_ranges`, the lowest ranges are folded into a floor, and every id below the floor
counts as trained. A row that far behind the newest trained one cannot still be in flight (the off-policy bound and
the lease timeout close it long before), so nothing that could legitimately arrive is refused; the controller's
journal remains the record of which rows were trained.

Pure logic, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

DEFAULT_MAX_RANGES = 65536


class RowIdSet:
    """A set of non-negative row ids stored as sorted, disjoint, non-adjacent half-open ranges `[start, end)`."""

    def __init__(self, ranges: Iterable[Sequence[int]] = (), *, floor: int = 0, max_ranges: int = DEFAULT_MAX_RANGES):
        if max_ranges < 1:
            raise ValueError(f"max_ranges must be >= 1, got {max_ranges}")
        self.max_ranges = max_ranges
        self.floor = floor  # every id below it counts as trained
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self._add_range(int(start), int(end))

    @classmethod
    def of(cls, ids: Iterable[int], *, max_ranges: int = DEFAULT_MAX_RANGES) -> RowIdSet:
        out = cls(max_ranges=max_ranges)
        for row in ids:
            out.add(row)
        return out

    def __contains__(self, row: object) -> bool:
        if not isinstance(row, int) or row < 0:
            return False
        if row < self.floor:
            return True
        i = bisect.bisect_right(self._starts, row) - 1
        return i >= 0 and row < self._ends[i]

    def __len__(self) -> int:
        """Ids held in ranges (the floor's ids are not counted: they were forgotten)."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def num_ranges(self) -> int:
        return len(self._starts)

    def ranges(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends, strict=True)]

    def add(self, row: int) -> None:
        if row < 0:
            raise ValueError(f"row ids are >= 0, got {row}")
        self._add_range(row, row + 1)

    def update(self, rows: Iterable[int]) -> None:
        for row in rows:
            self.add(row)

    def _add_range(self, start: int, end: int) -> None:
        if end <= self.floor:
            return
        start = max(start, self.floor)
        # Ranges that overlap or touch [start, end) merge with it.
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]
        if len(self._starts) > self.max_ranges:
            self._fold()

    def _fold(self) -> None:
        """Fold the lowest ranges (and the gaps between them) into the floor until `max_ranges` hold the rest."""
        drop = len(self._starts) - self.max_ranges
        self.floor = self._ends[drop - 1]
        del self._starts[:drop]
        del self._ends[:drop]

    def to_json(self) -> dict[str, object]:
        return {"floor": self.floor, "ranges": self.ranges()}

    @classmethod
    def from_json(cls, data: dict[str, object], *, max_ranges: int = DEFAULT_MAX_RANGES) -> RowIdSet:
        ranges = data.get("ranges") or []
        return cls(ranges, floor=int(data.get("floor") or 0), max_ranges=max_ranges)  # type: ignore[arg-type]
