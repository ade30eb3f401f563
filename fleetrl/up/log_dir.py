"""A run's `log_path` before `fleetrl up` (or `fleetrl.main`) starts in it.

A log_path that holds a run (its controller journal, metrics.jsonl, checkpoints or final export) is either
continued (`--resume`) or deliberately started over (`--overwrite`, which deletes that run's files first), never
mixed into: a new run there would keep the old checkpoints (a later `--resume` would load them), the old final
model, and append to the old logs. A log_path with only the logs of a start that failed before the controller
came up holds no run: those logs are removed so the new run's logs start clean.
"""

from __future__ import annotations

import shutil
from pathlib import Path

JOURNAL = "controller.sqlite"
RUN_FILES = (
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    JOURNAL,
    f"{JOURNAL}-wal",
    f"{JOURNAL}-shm",
    "curves.png",
    # The trackers' files (fleetrl.trackers): a new run must not continue the old run's W&B or MLflow run.
    "samples.jsonl",
    "config.json",
    "wandb_run_id",
    "mlflow_run_id",
    "wandb",
    "tensorboard",
    "mlruns",
)
SERVICE_LOGS = ("controller.log", "trainer*.log", "reference.log", "inference-*.log", "gateway-*.log")


class LogDirError(ValueError):
    """The log_path cannot be used as asked; the message says what to do."""


def _not_empty(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def run_files(log_dir: Path, checkpoint_dir: Path, output_dir: Path) -> list[Path]:
    """The journal, record, checkpoints and export an earlier run left (empty folders do not count)."""
    found = [log_dir / name for name in RUN_FILES if (log_dir / name).exists()]
    found += [d for d in dict.fromkeys((checkpoint_dir, output_dir)) if _not_empty(d)]
    return found


def service_logs(log_dir: Path) -> list[Path]:
    logs = [p for pattern in SERVICE_LOGS for p in sorted(log_dir.glob(pattern))]
    ready = log_dir / "ready"
    return [*logs, ready] if ready.exists() else logs


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prepare_log_dir(
    log_dir: Path, *, resume: bool, overwrite: bool, checkpoint_dir: Path, output_dir: Path, journal: Path | None = None
) -> list[Path]:
    """Check `log_dir` for a new run (or a resume) and clear what must go; returns the paths removed.

    Raises LogDirError: --resume with no run to resume, or a new run in a log_path that holds one without
    --overwrite."""
    journal = journal or log_dir / JOURNAL
    if resume and overwrite:
        raise LogDirError("--resume continues the run in log_path and --overwrite deletes it: choose one")
    if resume:
        if not journal.exists():
            raise LogDirError(
                f"--resume: {log_dir} holds no run to resume (no {journal.name}); start it without --resume"
            )
        return []
    found = run_files(log_dir, checkpoint_dir, output_dir)
    if journal.exists() and journal not in found:
        found.append(journal)
    if found and not overwrite:
        names = ", ".join(_shown(p, log_dir) for p in found)
        raise LogDirError(
            f"{log_dir} holds a run ({names}): continue it with --resume, or start over with --overwrite "
            "(deletes them and the run's logs)"
        )
    removed = [*found, *service_logs(log_dir)]
    for path in removed:
        _remove(path)
    return removed


def _shown(path: Path, log_dir: Path) -> str:
    try:
        name = str(path.relative_to(log_dir))
    except ValueError:
        name = str(path)
    return f"{name}/" if path.is_dir() else name
