"""The dataset cursor: rows over epochs, shuffled per epoch with a seed, resumable from a position.

A row's identity is its occurrence `(epoch, index)`, flattened into `row_id = epoch * len(rows) + index`, so a
row that is leased, lost and requeued keeps its id and the trainer can deduplicate by it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetrl.controller.rows import load_jsonl_rows, open_rows, shuffled_order

__all__ = ["CursorPosition", "DatasetCursor", "load_jsonl_rows", "load_rows"]


@dataclass(frozen=True)
class CursorPosition:
    """Where the cursor is: the next row to hand out is `order(epoch)[index]`."""

    epoch: int = 0
    index: int = 0


def load_rows(path: str | Path, max_rows: int | None = None) -> Sequence[dict[str, Any]]:
    """The rows of a dataset: JSONL, Parquet, a `save_to_disk` folder or a cached hub id, memory-mapped through HF
    `datasets` (fleetrl/controller/rows.py). Nested columns (chat messages, a `reward_model` struct) come back as
    lists and dicts."""
    return open_rows(path, max_rows)


class DatasetCursor:
    """Hands out `(row_id, row)` pairs in epoch order; `None` once every epoch is used."""

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        epochs: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        position: CursorPosition | None = None,
    ) -> None:
        if not rows:
            raise ValueError("dataset: no rows")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.rows = rows  # not copied: a memory-mapped dataset stays on disk
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.position = position or CursorPosition()
        self._order_epoch = -1
        self._order: array | range = range(0)

    def _order_for(self, epoch: int) -> array | range:
        if epoch != self._order_epoch:
            size = len(self.rows)
            order = shuffled_order(size, self.seed * 1_000_003 + epoch) if self.shuffle else range(size)
            self._order_epoch, self._order = epoch, order
        return self._order

    @property
    def total_rows(self) -> int:
        return len(self.rows) * self.epochs

    @property
    def consumed(self) -> int:
        return self.position.epoch * len(self.rows) + self.position.index

    def exhausted(self) -> bool:
        return self.position.epoch >= self.epochs

    def next(self) -> tuple[int, dict[str, Any]] | None:
        if self.exhausted():
            return None
        epoch, index = self.position.epoch, self.position.index
        row_index = self._order_for(epoch)[index]
        index += 1
        self.position = CursorPosition(epoch + 1, 0) if index >= len(self.rows) else CursorPosition(epoch, index)
        return epoch * len(self.rows) + row_index, self.rows[row_index]

    def row(self, row_id: int) -> dict[str, Any]:
        """The row behind an id (for a requeued row)."""
        return self.rows[row_id % len(self.rows)]

    def journal_state(self) -> list[int]:
        """What the controller's journal keeps: [epoch, index]."""
        return [self.position.epoch, self.position.index]

    def restore(self, state: Any) -> None:
        """Continue from `journal_state()`'s output ([epoch, index]); a mixture's journal is refused."""
        if not (isinstance(state, list | tuple) and len(state) == 2):
            raise ValueError(
                "dataset: the journal was written by a run with a dataset mixture (datasets); one dataset cannot "
                "continue it (start over with --overwrite)"
            )
        self.position = CursorPosition(int(state[0]), int(state[1]))
