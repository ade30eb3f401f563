"""The dataset cursor: rows over epochs, shuffled per epoch with a seed, resumable from a position.

A row's identity is its occurrence `(epoch, index)`, flattened into `row_id = epoch * len(rows) + index`, so a
row that is leased, lost and requeued keeps its id and the trainer can deduplicate by it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CursorPosition:
    """Where the cursor is: the next row to hand out is `order(epoch)[index]`."""

    epoch: int = 0
    index: int = 0


def load_rows(path: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Read a dataset of rows (dicts): JSONL, or Parquet (`.parquet`, as verl's data scripts write; needs
    pyarrow: `pip install 'fleetrl[parquet]'`). Nested columns (chat messages, a `reward_model` struct) come back
    as lists and dicts."""
    if Path(path).suffix.lower() == ".parquet":
        return load_parquet_rows(path, max_rows)
    return load_jsonl_rows(path, max_rows)


def load_parquet_rows(path: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install 'fleetrl[parquet]'") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a readable Parquet file: {exc}") from None
    if max_rows is not None:
        table = table.slice(0, max_rows)
    rows = table.to_pylist()
    if not rows:
        raise ValueError(f"{path}: the dataset has no rows")
    return rows


def load_jsonl_rows(path: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL dataset; a bad line fails with its line number."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each row must be a JSON object")
            rows.append(row)
            if max_rows is not None and len(rows) >= max_rows:
                break
    if not rows:
        raise ValueError(f"{path}: the dataset has no rows")
    return rows


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
        self.rows = list(rows)
        self.epochs = epochs
        self.shuffle = shuffle
        self.seed = seed
        self.position = position or CursorPosition()
        self._order_epoch = -1
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
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
