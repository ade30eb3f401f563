"""A dataset mixture's cursor: rows drawn from several sources by weight, resumable exactly per source.

Each source has its own `DatasetCursor` (its own epochs and seeded shuffle). Draw k picks a source with a random
number seeded by (run seed, k), among the sources with rows left and a positive weight at the step the draw
nominally fills (k // P + 1; fleetrl.dataset_sources: a weight may follow a schedule), then takes that source's next
row; a row outside the source's difficulty range is skipped (counted) and the draw goes on. So the rows drawn depend
on the seed and the number of draws only, and the cursor's state is that number and every source's position:
`journal_state()` goes into the controller's journal and `restore()` continues each source exactly where it stopped.

A row's id is `local * S + s` (s the source's index, S the number of sources, local its `DatasetCursor` id), unique
across sources and stable across retries; `source_of(row_id)` names its source. Pure: no sockets, no clock.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.controller.dataset import CursorPosition, DatasetCursor


def weight_at(weight: float, schedule: Sequence[tuple[int, float]] | None, step: int) -> float:
    """A source's weight at `step`: `weight`, or the schedule's (step, weight) points interpolated linearly, flat
    before the first and after the last."""
    if not schedule:
        return weight
    points = sorted(schedule)
    if step <= points[0][0]:
        return float(points[0][1])
    for (s0, w0), (s1, w1) in itertools.pairwise(points):
        if step <= s1:
            return float(w0 + (w1 - w0) * (step - s0) / (s1 - s0))
    return float(points[-1][1])


def pick_source(weights: Sequence[float], u: float) -> int:
    """The index whose share of `weights` (not all 0) holds `u` in [0, 1)."""
    pick = u * math.fsum(weights)
    last = max(i for i, w in enumerate(weights) if w > 0)
    for i, w in enumerate(weights):
        if w > 0 and pick < w:
            return i
        pick -= w
    return last  # rounding at the very top of the range


def difficulty_filter(field_name: str, low: float | None, high: float | None) -> Callable[[Mapping[str, Any]], bool]:
    """Whether a row's `field_name` is a number within [low, high] (a missing or non-numeric value is not)."""

    def keep(row: Mapping[str, Any]) -> bool:
        value = row.get(field_name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        return (low is None or value >= low) and (high is None or value <= high)

    return keep


@dataclass
class MixtureSource:
    """A source of the mixture: its name, its own cursor, its weight (and schedule) and an optional row filter."""

    name: str
    cursor: DatasetCursor
    weight: float = 1.0
    schedule: tuple[tuple[int, float], ...] = ()
    keep: Callable[[Mapping[str, Any]], bool] | None = None
    drawn: int = 0  # rows handed out
    skipped: int = 0  # rows passed over by the filter

    def weight_at(self, step: int) -> float:
        return weight_at(self.weight, self.schedule, step)

    def retired_from(self, step: int) -> bool:
        """No rows left, or a weight of 0 at `step` and at every later point of its schedule."""
        if self.cursor.exhausted():
            return True
        later = [w for s, w in self.schedule if s > step]
        return self.weight_at(step) <= 0 and all(w <= 0 for w in later)


@dataclass
class MixtureCursor:
    """The `DatasetCursor` interface over several sources (see the module docstring)."""

    sources: list[MixtureSource]
    seed: int = 0
    groups_per_step: int = 1
    draws: int = 0
    _names: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("datasets: no sources")
        self._names = {s.name: i for i, s in enumerate(self.sources)}
        if len(self._names) != len(self.sources):
            raise ValueError("datasets: source names repeat")

    # --- the DatasetCursor interface ----------------------------------------------------------
    @property
    def position(self) -> CursorPosition:
        """Draws made, as a position (epoch 0): what snapshots and the trainer's data_position show."""
        return CursorPosition(0, self.draws)

    @property
    def total_rows(self) -> int:
        return sum(s.cursor.total_rows for s in self.sources)

    @property
    def consumed(self) -> int:
        return sum(s.cursor.consumed for s in self.sources)

    def step_of_draw(self, draw: int) -> int:
        """The step draw `draw` (0-based) nominally fills: P rows a step."""
        return draw // max(self.groups_per_step, 1) + 1

    def exhausted(self) -> bool:
        step = self.step_of_draw(self.draws)
        return all(s.retired_from(step) for s in self.sources)

    def next(self) -> tuple[int, dict[str, Any]] | None:
        """The next row drawn by the mixture, or None once no source has rows left to draw."""
        while True:
            step = self.step_of_draw(self.draws)
            weights = [0.0 if s.cursor.exhausted() else s.weight_at(step) for s in self.sources]
            if sum(weights) <= 0:
                if self.exhausted():
                    return None
                # Every source with rows has weight 0 here but gets some later: skip ahead to that step's draws.
                self.draws = self._next_live_draw(step)
                continue
            index = pick_source(weights, random.Random(f"{self.seed}:{self.draws}").random())
            self.draws += 1
            source = self.sources[index]
            nxt = source.cursor.next()
            if nxt is None:  # cannot happen (exhausted sources have weight 0); stay safe
                continue
            local_id, row = nxt
            if source.keep is not None and not source.keep(row):
                source.skipped += 1
                continue
            source.drawn += 1
            return local_id * len(self.sources) + index, row

    def _next_live_draw(self, step: int) -> int:
        points = sorted({s for src in self.sources if not src.cursor.exhausted() for s, _ in src.schedule if s > step})
        for later in points:
            if any(not src.cursor.exhausted() and src.weight_at(later) > 0 for src in self.sources):
                return (later - 1) * max(self.groups_per_step, 1)
        return self.draws + 1  # unreachable while exhausted() is False; moves on regardless

    def row(self, row_id: int) -> dict[str, Any]:
        """The row behind an id (for a requeued row)."""
        source = self.sources[row_id % len(self.sources)]
        return source.cursor.row(row_id // len(self.sources))

    # --- mixture specifics --------------------------------------------------------------------
    def source_of(self, row_id: int) -> str:
        return self.sources[row_id % len(self.sources)].name

    def journal_state(self) -> dict[str, Any]:
        """What the journal keeps to continue exactly: the draws and every source's position and counts."""
        return {
            "draws": self.draws,
            "sources": {
                s.name: {
                    "epoch": s.cursor.position.epoch,
                    "index": s.cursor.position.index,
                    "drawn": s.drawn,
                    "skipped": s.skipped,
                }
                for s in self.sources
            },
        }

    def restore(self, state: Any) -> None:
        """Continue from `journal_state()`'s output. A source the journal does not know (added to the config since)
        starts at its beginning; a journal written by a single-dataset run is refused."""
        if not isinstance(state, dict) or "sources" not in state:
            raise ValueError(
                "datasets: the journal was written by a run with one dataset; a mixture cannot continue it "
                "(start over with --overwrite)"
            )
        self.draws = int(state.get("draws", 0))
        for source in self.sources:
            saved = state["sources"].get(source.name)
            if saved is None:
                continue
            source.cursor.position = CursorPosition(int(saved["epoch"]), int(saved["index"]))
            source.drawn, source.skipped = int(saved.get("drawn", 0)), int(saved.get("skipped", 0))

    def figures(self) -> dict[str, float]:
        """Per source: rows drawn and skipped so far, and its weight at the current step (`data/<name>/...`)."""
        step = self.step_of_draw(self.draws)
        out: dict[str, float] = {}
        for s in self.sources:
            out[f"data/{s.name}/rows_drawn"] = float(s.drawn)
            out[f"data/{s.name}/rows_skipped"] = float(s.skipped)
            out[f"data/{s.name}/weight"] = s.weight_at(step)
        return out


def source_rewards(
    row_ids: Sequence[int], rewards: Mapping[int, Sequence[float]], source_of: Callable[[int], str]
) -> dict[str, float]:
    """A step's per-source figures: `data/<name>/groups` (its rows in the step) and `data/<name>/reward_mean` (the
    mean reward of their samples, when reported)."""
    groups: dict[str, int] = {}
    values: dict[str, list[float]] = {}
    for row_id in row_ids:
        name = source_of(row_id)
        groups[name] = groups.get(name, 0) + 1
        values.setdefault(name, []).extend(float(r) for r in rewards.get(row_id, ()))
    out: dict[str, float] = {}
    for name, count in groups.items():
        out[f"data/{name}/groups"] = float(count)
        if values[name]:
            out[f"data/{name}/reward_mean"] = math.fsum(values[name]) / len(values[name])
    return out


def build_mixture(
    sources: Sequence[Any],
    rows: Sequence[Sequence[dict[str, Any]]],
    *,
    epochs: int,
    shuffle: bool,
    seed: int,
    groups_per_step: int,
) -> MixtureCursor:
    """The cursor of `run.datasets` (fleetrl.dataset_sources.DatasetSource, one per source) over each source's rows:
    every source its own cursor (its own seeded shuffle), weight, schedule and difficulty filter."""
    built = []
    for i, (source, source_rows) in enumerate(zip(sources, rows, strict=True)):
        if not source_rows:
            raise ValueError(f"datasets[{i}] ({source.path}): no rows")
        keep = None
        if source.difficulty_field:
            keep = difficulty_filter(source.difficulty_field, source.min_difficulty, source.max_difficulty)
        built.append(
            MixtureSource(
                name=source.source_name,
                cursor=DatasetCursor(source_rows, epochs=epochs, shuffle=shuffle, seed=seed * 1_009 + i),
                weight=float(source.weight),
                schedule=tuple((int(s), float(w)) for s, w in source.weight_schedule or ()),
                keep=keep,
            )
        )
    return MixtureCursor(built, seed=seed, groups_per_step=groups_per_step)


MAX_ROWS = 65_536  # rows accepted but never trained (superseded, stale) are forgotten oldest first past this


class RowRewards:
    """The rewards each accepted row's report carried, until its step's line (a retried row's last report wins);
    non-finite values are ignored. Bounded like fleetrl.controller.row_phases."""

    def __init__(self) -> None:
        self._rows: dict[int, list[float]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, row_id: int, rewards: Sequence[float]) -> None:
        self._rows.pop(int(row_id), None)
        self._rows[int(row_id)] = [float(r) for r in rewards if math.isfinite(r)]
        while len(self._rows) > MAX_ROWS:
            del self._rows[next(iter(self._rows))]

    def take_step(self, row_ids: Sequence[int], source_of: Callable[[int], str]) -> dict[str, float]:
        """The step's per-source figures (`source_rewards`); those rows are forgotten."""
        rewards = {int(r): self._rows.pop(int(r), []) for r in row_ids}
        return source_rewards(row_ids, rewards, source_of)
