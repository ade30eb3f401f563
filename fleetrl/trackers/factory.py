"""`make_trackers`: the run's `TrackerSet` from its config, each backend imported only when named."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from fleetrl.trackers.base import Tracker, TrackerError
from fleetrl.trackers.fanout import TrackerSet
from fleetrl.trackers.jsonl import JsonlTracker
from fleetrl.trackers.names import check_logger_names, missing_extra


def check_trackers_available(names: list[str]) -> None:
    """`TrackerError` naming the extra to install for the first backend whose client library is missing."""
    for name in names:
        if message := missing_extra(name):
            raise TrackerError(message)


def make_trackers(cfg: Any, *, metrics_path: Path | None = None, resume: bool = False) -> TrackerSet:
    """The trackers `cfg.loggers` names (jsonl always), started. `resume`: continue the W&B and MLflow runs whose
    ids the log folder keeps. Raises `TrackerError` naming the tracker that cannot start (the others are closed)."""
    names = check_logger_names(cfg.loggers)
    check_trackers_available(names)
    log_dir = Path(cfg.log_path)
    trackers: list[Tracker] = []
    try:
        for name in names:
            trackers.append(_start(name, cfg, log_dir, metrics_path or log_dir / "metrics.jsonl", resume))
    except Exception as exc:
        for started in trackers:
            with contextlib.suppress(Exception):
                started.close(failed=True)
        if isinstance(exc, TrackerError):
            raise
        raise TrackerError(f"loggers: {name!r} could not start: {type(exc).__name__}: {exc}") from exc
    return TrackerSet(trackers)


def _start(name: str, cfg: Any, log_dir: Path, metrics_path: Path, resume: bool) -> Tracker:
    if name == "jsonl":
        return JsonlTracker(log_dir, metrics_path)
    if name == "wandb":
        from fleetrl.trackers.wandb_tracker import WandbTracker

        return WandbTracker(
            log_dir,
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            run_name=cfg.wandb_run_name,
            tags=cfg.wandb_tags,
            resume=resume,
        )
    if name == "tensorboard":
        from fleetrl.trackers.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(log_dir)
    if name == "mlflow":
        from fleetrl.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(
            log_dir,
            tracking_uri=cfg.mlflow_tracking_uri,
            experiment=cfg.mlflow_experiment,
            run_name=cfg.wandb_run_name,
            resume=resume,
        )
    raise TrackerError(f"loggers: unknown tracker {name!r}")
