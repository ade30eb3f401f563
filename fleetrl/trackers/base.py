"""The tracker interface: where a run's per-step metrics, evaluation results, config and samples go.

    tracker.log_config({"learning_rate": 1e-5, ...})     # once, at start
    tracker.log_metrics(3, {"train/loss": 0.1, ...})      # one per-step (or evaluation) line of metrics.jsonl
    tracker.log_samples(3, [{"prompt": ..., "completion": ..., "reward": 1.0, ...}])
    tracker.close()

One implementation per backend, each with the backend's own client library (fleetrl.trackers.jsonl, .wandb_tracker,
.tensorboard_tracker, .mlflow_tracker); `TrackerSet` fans out to them and decides what a failure does.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

RUN_ID_FILES = {"wandb": "wandb_run_id", "mlflow": "mlflow_run_id"}
"""Files in the log folder holding a backend's run id, so `fleetrl up --resume` continues the same run."""


class TrackerError(RuntimeError):
    """A tracker that cannot start (missing extra, bad credentials, unreachable server); the message says which."""


class Tracker(ABC):
    """One backend. Methods may raise; `TrackerSet` handles failures."""

    name: str = ""
    required: bool = False
    """A required tracker's failure fails the run (the jsonl record); any other's is logged, counted and survived."""

    @abstractmethod
    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved run config (a flat dict of JSON values)."""

    @abstractmethod
    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One line of metrics.jsonl: a trained step's figures, or an evaluation's `eval/*` at `step` = version."""

    @abstractmethod
    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A few decoded samples of step `step` (fleetrl.sample_log.SAMPLE_COLUMNS)."""

    def close(self, failed: bool = False) -> None:  # noqa: B027 - most backends have nothing to close
        """End of run (`failed`: the run ended on an error)."""


NOT_PLOTTED = ("step", "time")  # the x axis, and the wall-clock time every backend records by itself


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics line to plot (not `step` and `time`; bools and strings are not plotted)."""
    out = {}
    for key, value in metrics.items():
        if key in NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def samples_markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of samples (TensorBoard's text plugin renders it)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
