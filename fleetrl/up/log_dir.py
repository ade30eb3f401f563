"""A run's `log_path` before `fleetrl up` (or `fleetrl.main`) starts in it.

A log_path that holds a run (its controller journal, metrics.jsonl, checkpoints or final export) is either
continued (`--resume`) or deliberately started over (`--overwrite`, which deletes that run's files first), never
mixed into: a new run there would keep the old checkpoints (a later `--resume` would load them), the old final
model, and append to the old logs. A log_path with only the logs of a start that failed before the controller
came up holds no run: those logs are removed so the new run's logs start clean.

A run's folders are owned by one live run (`lock_run_folders`): `fleetrl up` holds an OS lock on `run.lock` in
its log_path, its checkpoint folder and its output folder for the run's life (its services inherit them), so a
second start that names any of them, plain, `--resume` or `--overwrite`, whatever its own log_path, is refused
naming the live run (its pid and log_path) before it reads or deletes anything; `--overwrite` empties an owned
folder but keeps its `run.lock`. A crashed run (the OS released its locks) can still be resumed.
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
    """The OS locks that make a live run the owner of its folders (`lock_run_folders`): its log_path's `run.lock`
    (`path`, `fd`) and the `run.lock` of each other folder it writes (checkpoints, final export). The kernel
    releases them when every process holding their descriptors (`fleetrl up` and the services it started) has
    exited, however they ended, so a crashed run can be resumed."""

    def __init__(self, path: Path, fd: int, others: list[tuple[Path, int]] | None = None) -> None:
        self.path = path
        self.fd = fd
        self.others = others or []

    @property
    def held(self) -> set[Path]:
        """The lock files this run holds (resolved)."""
        return {p.resolve() for p in (self.path, *(path for path, _ in self.others))}

    @property
    def fds(self) -> tuple[int, ...]:
        """Every descriptor the services must inherit to keep the folders owned."""
        return tuple(fd for fd in (self.fd, *(fd for _, fd in self.others)) if fd >= 0)

    def release(self) -> None:
        """Unlock now (`fleetrl.main()` returning in a process that goes on); the files stay."""
        for fd in self.fds:
            os.close(fd)
        self.fd = -1
        self.others = []


def _holder(fd: int, wait_s: float = 1.0) -> tuple[str, str]:
    """The pid and log_path the lock's holder wrote (it writes them right after locking: wait a little)."""
    deadline = time.monotonic() + wait_s
    while True:
        os.lseek(fd, 0, os.SEEK_SET)
        lines = os.read(fd, 4096).decode(errors="replace").splitlines()
        if (lines and lines[0].strip()) or time.monotonic() >= deadline:
            pid = lines[0].strip() if lines and lines[0].strip() else "unknown"
            return pid, lines[1].strip() if len(lines) > 1 else ""
        time.sleep(0.02)


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _refusal(subject: str, what: str, pid: str, holder_log: str, same: bool = False) -> LogDirError:
    """The error for a folder (`subject`) that the run with `pid` and `holder_log` owns (`same`: it is that run's
    log_path, named by the pid alone as before)."""
    owner = "" if not holder_log or same else f", log_path {holder_log}"
    if pid != "unknown" and not _pid_alive(pid):
        return LogDirError(
            f"{subject} is still in use: the services of the run whose `fleetrl up` (pid {pid}{owner}) ended are "
            "still stopping (a trainer may be writing its checkpoint); start again once they have exited"
        )
    return LogDirError(
        f"{subject} is in use by a live run (`fleetrl up`, pid {pid}{owner}): stop it first (Ctrl-C, or kill "
        f"-TERM {pid}; then --resume continues it), or give this run another log_path"
        + ("" if what == "run.log_path" else f" and {what}")
    )


def _subject(folder: Path, what: str) -> str:
    return f"{folder}" if what == "run.log_path" else f"{what} {folder}"


def _lock_folder(folder: Path, what: str, log_dir: Path) -> int:
    """flock `<folder>/run.lock` and write this process's pid and `log_dir` in it; the descriptor. Raises
    LogDirError naming the live run that holds it (`what`: the folder's role in this run, for the message)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a file in the way, no permission, a full disk
        raise LogDirError(f"{what}: cannot use {folder}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, holder_log = _holder(fd)
        os.close(fd)
        same = what == "run.log_path" and Path(holder_log) == folder.resolve()
        raise _refusal(_subject(folder, what), what, pid, holder_log, same) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # the pid and log_path are only for the message of a refused start
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{log_dir.resolve()}\n".encode())
    return fd


def _live_holder(lock_file: Path) -> tuple[str, str] | None:
    """(pid, log_path) of the run that holds `lock_file` now, or None when none does (or there is no such file).
    A shared probe: it never blocks a holder, and closing it releases only itself (flock is per open file)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        return None
    finally:
        os.close(fd)


def _check_not_inside_a_live_run(folder: Path, what: str, held: set[Path]) -> None:
    """Refuse `folder` when it or a folder above it is owned by another live run (its `run.lock` held): e.g. the
    output folder `<log_path>/final` of a live run, which that run has not created yet."""
    for above in (folder.resolve(), *folder.resolve().parents):
        lock_file = above / LOCK_FILE
        if lock_file in held or (holder := _live_holder(lock_file)) is None:
            continue
        where = "" if above == folder.resolve() else f" (inside {above})"
        raise _refusal(f"{_subject(folder, what)}{where}", what, *holder)


def live_locks_inside(folder: Path, held: set[Path]) -> list[Path]:
    """The `run.lock` files under `folder` (not in `held`) that another live run holds: what `--overwrite` must
    not delete."""
    found = []
    for dirpath, _dirs, files in os.walk(folder):
        lock_file = Path(dirpath).resolve() / LOCK_FILE
        if LOCK_FILE in files and lock_file not in held and _live_holder(lock_file) is not None:
            found.append(lock_file)
    return found


def lock_log_dir(log_dir: Path) -> RunLock:
    """Make this process the owner of `log_dir` for the run's life, or raise LogDirError naming the live run
    (its `fleetrl up` pid) that owns it. Creates `log_dir` if needed; call before reading or deleting anything
    in it."""
    return RunLock(log_dir / LOCK_FILE, _lock_folder(log_dir, "run.log_path", log_dir))


def lock_run_folders(log_dir: Path, folders: dict[str, Path], unlocked: dict[str, Path] | None = None) -> RunLock:
    """`lock_log_dir`, then each of the run's other folders (`folders`: its role, e.g. "the checkpoint folder", to
    its path), and check the folders it writes later (`unlocked`: the final export, not created before it is
    written): a folder that another live run owns (its log_path, its checkpoints, or a folder inside them, such
    as its export) is refused naming that run. All or nothing: on a refusal the locks taken are released."""
    lock = lock_log_dir(log_dir)
    try:
        for what, folder in folders.items():
            if folder.resolve() in {p.parent.resolve() for p in lock.held}:
                continue
            lock.others.append((folder / LOCK_FILE, _lock_folder(folder, what, log_dir)))
        held = lock.held
        for what, folder in {"run.log_path": log_dir, **folders, **(unlocked or {})}.items():
            _check_not_inside_a_live_run(folder, what, held)
    except BaseException:
        lock.release()
        raise
    return lock


def _not_empty(path: Path) -> bool:
    """A folder that holds something besides its owner's lock."""
    return path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir())


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
    if path.is_dir() and not path.is_symlink() and (path / LOCK_FILE).exists():
        for inner in path.iterdir():  # an owned folder: its lock stays (unlinked, a second run could lock anew)
            if inner.name != LOCK_FILE:
                _remove(inner)
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def prepare_log_dir(
    log_dir: Path,
    *,
    resume: bool,
    overwrite: bool,
    checkpoint_dir: Path,
    output_dir: Path,
    journal: Path | None = None,
    held: set[Path] | None = None,
) -> list[Path]:
    """Check `log_dir` for a new run (or a resume) and clear what must go; returns the paths removed.

    Raises LogDirError: --resume with no run to resume, a new run in a log_path that holds one without
    --overwrite, or an --overwrite that would delete a folder another live run owns (a `run.lock` inside it that
    is not in `held`, this run's own)."""
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
        if path.is_dir() and (owned := live_locks_inside(path, held or set())):
            pid, holder_log = _live_holder(owned[0]) or ("unknown", "")
            raise LogDirError(
                f"--overwrite would delete {owned[0].parent}, owned by a live run (`fleetrl up`, pid {pid}, log_path "
                f"{holder_log}): nothing was deleted; stop that run first, or give this run other folders"
            )
    for path in removed:
        _remove(path)
    return removed


def _shown(path: Path, log_dir: Path) -> str:
    try:
        name = str(path.relative_to(log_dir))
    except ValueError:
        name = str(path)
    return f"{name}/" if path.is_dir() else name
