"""The results of a trainer's last steps, kept in its checkpoint (`TrainerState.step_records`), so a trainer that
resumes still has them.

A controller killed while the trainer trained a step never hears back about it: the trainer checkpoints that step
(at its save interval, or as it is stopped), and the resumed controller counts its rows as trained but has no
metrics line or logged samples for it. The resumed trainer answers a TrainStep for a step it already trained with
that step's result again, from these records, and the controller writes what its record lacks
(`fleetrl.controller.step_recovery`). A missing line can only be of the last step or two (the controller's journal
is at most one step behind the trainer, and a step's line is written right after its reply), so a few records are
kept. JSON only, as the rest of the trainer's state. Pure: no torch, no sockets.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

from fleetrl.sample_log import SAMPLE_COLUMNS, TOKEN_ID_COLUMNS, LoggedSample

log = logging.getLogger(__name__)

RECORDS_KEPT = 4
"""Step results a checkpoint keeps (the newest)."""


class StepResultLike(Protocol):
    """What a record is made of (fleetrl.trainer.policy_trainer.StepResult)."""

    step: int
    version: int
    metrics: dict[str, float]
    row_ids: list[int]
    skipped_row_ids: list[int]
    samples: list[LoggedSample]


def step_record(result: StepResultLike) -> dict[str, Any]:
    """A step's result as JSON-ready data: its step, version, metrics, rows and logged samples. A non-finite
    figure is kept as None (JSON has no NaN) and read back as NaN."""
    return {
        "step": int(result.step),
        "version": int(result.version),
        "metrics": {str(k): float(v) if math.isfinite(float(v)) else None for k, v in result.metrics.items()},
        "row_ids": [int(r) for r in result.row_ids],
        "skipped_row_ids": [int(r) for r in result.skipped_row_ids],
        "samples": [s.as_row() for s in result.samples],
    }


def keep_recent(records: Sequence[dict[str, Any]], record: dict[str, Any], kept: int = RECORDS_KEPT) -> list[dict]:
    """`records` with `record` added (replacing one of its step), the newest `kept` steps only, oldest first."""
    by_step = {int(r["step"]): r for r in records if isinstance(r, dict) and "step" in r}
    by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)[-kept:]]


def result_fields(record: Any) -> dict[str, Any] | None:
    """The StepResult fields (step, version, metrics, row_ids, skipped_row_ids, samples) of a record read from a
    checkpoint, or None (with a warning) for one that is not a record: a damaged record costs its step's line,
    never the resume."""
    try:
        columns = (*SAMPLE_COLUMNS, *TOKEN_ID_COLUMNS)
        samples = [LoggedSample(**{k: s[k] for k in columns if k in s}) for s in record.get("samples", [])]
        return {
            "step": int(record["step"]),
            "version": int(record["version"]),
            "metrics": {str(k): math.nan if v is None else float(v) for k, v in record["metrics"].items()},
            "row_ids": [int(r) for r in record.get("row_ids", [])],
            "skipped_row_ids": [int(r) for r in record.get("skipped_row_ids", [])],
            "samples": samples,
        }
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        log.warning("a step record in the checkpoint is unreadable (%s: %s); ignored", type(exc).__name__, exc)
        return None
