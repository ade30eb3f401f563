"""A run's `log_path` before `fleetrl up` (or `fleetrl.main`) starts in it.

A log_path that holds a run (its controller journal, metrics.jsonl, checkpoints or final export) is either
continued (`--resume`) or deliberately started over (`--overwrite`, which deletes that run's files first), never
mixed into: a new run there would keep the old checkpoints (a later `--resume` would load them), the old final
model, and append to the old logs. A log_path with only the logs of a start that failed before the controller
came up holds no run: those logs are removed so the new run's logs start clean.

A log_path is owned by one live run (`lock_log_dir`): `fleetrl up` holds an OS lock on `<log_path>/run.lock` for
the run's life (its services inherit it), so a second start there, plain, `--resume` or `--overwrite`, is refused
naming the live run's pid before it reads or deletes anything, while a crashed run (the OS released its lock) can
still be resumed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

JOURNAL = "controller.sqlite"
RUN_FILES = (
    "metrics.jsonl",
    "metrics.superseded.jsonl",
    JOURNAL,
    f"{JOURNAL}-wal",
    f"{JOURNAL}-shm",
    "curves.png",
    "run_end.json",  # how the run ended (services/controller/server.py)
    # The trackers' files (fleetrl.trackers): a new run must not continue the old run's W&B or MLflow run.
    "samples.jsonl",
    "samples.superseded.jsonl",
    "config.json",
    "wandb_run_id",
    "mlflow_run_id",
    "wandb",
    "tensorboard",
    "mlruns",
)
SERVICE_LOGS = ("controller.log", "trainer*.log", "reference.log", "inference-*.log", "gateway-*.log")


LOCK_FILE = "run.lock"
"""In log_path: locked (flock) by the live run that owns the folder, and holding its pid. Never deleted: a lock
file unlinked while another process holds it open would let two runs lock two different files."""


class LogDirError(ValueError):
    """The log_path cannot be used as asked; the message says what to do."""


class RunLock:
    """The OS lock that makes a live run the owner of its log_path (`lock_log_dir`). The kernel releases it when
    every process holding its descriptor (`fleetrl up` and the services it started) has exited, however they
    ended, so a crashed run can be resumed."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def release(self) -> None:
        """Unlock now (`fleetrl.main()` returning in a process that goes on); the file stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _holder(fd: int, wait_s: float = 1.0) -> str:
    """The pid the lock's holder wrote (it writes it right after locking: wait a little for it)."""
    deadline = time.monotonic() + wait_s
    while True:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode(errors="replace").strip()
        if text or time.monotonic() >= deadline:
            return text or "unknown"
        time.sleep(0.02)


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def lock_log_dir(log_dir: Path) -> RunLock:
    """Make this process the owner of `log_dir` for the run's life, or raise LogDirError naming the live run
    (its `fleetrl up` pid) that owns it. Creates `log_dir` if needed; call before reading or deleting anything
    in it."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a file in the way, no permission, a full disk
        raise LogDirError(f"run.log_path: cannot use {log_dir}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        os.close(fd)
        if pid != "unknown" and not _pid_alive(pid):
            raise LogDirError(
                f"{log_dir} is still in use: the services of the run whose `fleetrl up` (pid {pid}) ended are still "
                "stopping (a trainer may be writing its checkpoint); start again once they have exited"
            ) from None
        raise LogDirError(
            f"{log_dir} is in use by a live run (`fleetrl up`, pid {pid}): stop it first (Ctrl-C, or kill -TERM "
            f"{pid}; then --resume continues it), or give this run another log_path"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # the pid is only for the message of a refused start
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return RunLock(path, fd)


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
