"""The controller's SQLite journal: version, cursor, step and counters, and one ledger line per row.

Every change the scheduler makes is written through here in a single transaction, so a restarted controller
resumes where it was. Row statuses: leased, accepted (waiting for a step), assigned (in step k), trained,
rejected, failed (gave up after repeated failures), queued (waiting to be leased again).

Another process may hold the database's lock for a while (a backup, an admin's `sqlite3` shell, a slow network
disk). Every statement then waits (SQLite's busy timeout, `busy_timeout_s`) and is retried with backoff, with a
warning every `warn_every_s` naming the file and how long it has waited; the run goes on once the lock is
released. A lock held past `give_up_s` (the controller's stall_timeout_s) raises `JournalLocked` saying so, and
the journal stays failed (`raise_if_failed`), so the run fails with that reason rather than a traceback. The
controller waits rather than running ahead of its journal: a journal behind by more than one step would not
align with the trainer's checkpoint at a resume.

A damaged file (`check_journal`, run by `fleetrl up --resume` before anything starts, and `Journal` itself) is
refused with `JournalDamaged`, one line naming the file and what SQLite says.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

ROW_STATUSES = ("leased", "accepted", "assigned", "trained", "rejected", "failed", "queued")
CLOSED_STATUSES = ("trained", "rejected", "failed")  # a row in one of these is done

_SCHEMA = """
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rows (
    row_id INTEGER PRIMARY KEY,
    status TEXT NOT NULL,
    submit_version INTEGER NOT NULL DEFAULT -1,
    attempts INTEGER NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT -1,
    trained_count INTEGER NOT NULL DEFAULT 0
);
"""


class JournalLocked(RuntimeError):
    """Another process held the journal's lock past the time the run may wait (`give_up_s`)."""


class JournalDamaged(ValueError):
    """The journal file is not a sound SQLite database with the journal's tables; the message names it."""


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def check_journal(path: str | Path) -> None:
    """Raise JournalDamaged (naming `path` and SQLite's reason) unless `path` is a sound journal: a SQLite
    database that passes `PRAGMA quick_check` and holds the journal's tables. Reads only (a crashed controller's
    WAL is recovered as the controller would recover it); a journal another process has locked is not judged."""
    if not Path(path).is_file():
        raise JournalDamaged(f"the journal {path} is missing")
    try:
        db = sqlite3.connect(str(path), timeout=5.0)
    except sqlite3.Error as exc:
        raise JournalDamaged(f"the journal {path} cannot be opened ({exc})") from None
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise JournalDamaged(f"the journal {path} is damaged (quick_check: {'; '.join(problems)[:200]})")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"state", "rows"} <= tables:
            raise JournalDamaged(f"the journal {path} is a SQLite database without the journal's tables")
    except sqlite3.OperationalError as exc:
        if not _is_busy(exc):
            raise JournalDamaged(f"the journal {path} is damaged ({exc})") from None
        # Locked by another process: not damaged as far as we know; the controller waits the lock out.
    except sqlite3.DatabaseError as exc:
        raise JournalDamaged(f"the journal {path} is damaged ({exc})") from None
    finally:
        db.close()


class Journal:
    """A small key/value + row ledger store on SQLite (WAL mode, one writer). `give_up_s`: how long a statement
    may wait for a lock another process holds (None: forever); `busy_timeout_s`: SQLite's own wait per try;
    `clock` and `sleep`: injectable for tests."""

    def __init__(
        self,
        path: str | Path,
        *,
        give_up_s: float | None = None,
        busy_timeout_s: float = 1.0,
        warn_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.path = str(path)
        self.give_up_s = give_up_s
        self.warn_every_s = warn_every_s
        self._clock = clock
        self._sleep = sleep
        self.failure: str | None = None  # set when a lock outlasted give_up_s: the run must fail with it
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                self._retry("set WAL mode", lambda: self._db.execute("PRAGMA journal_mode=WAL"))
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._retry("create its tables", lambda: self._db.executescript(_SCHEMA))
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
                raise
            self._db.close()
            raise JournalDamaged(f"the journal {self.path} is damaged ({exc})") from None
        self._pending_state: dict[str, Any] = {}
        self._pending_rows: dict[int, tuple[str, int, int, int, int]] = {}

    def _retry(self, what: str, attempt: Callable[[], T]) -> T:
        """Run `attempt` (one statement or transaction, holding `_lock`), retrying with backoff while another
        process holds the database's lock; warn every `warn_every_s`; past `give_up_s` raise JournalLocked."""
        self.raise_if_failed()
        started = self._clock()
        warned_at = started
        delay = 0.05
        while True:
            try:
                with self._lock:
                    return attempt()
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                waited = self._clock() - started
                if self.give_up_s is not None and waited >= self.give_up_s:
                    self.failure = (
                        f"the journal {self.path} stayed locked by another process for {waited:.0f} s (more than "
                        f"stall_timeout_s {self.give_up_s:.0f}) while trying to {what}: {exc}; stop whatever holds "
                        "it (a backup, an sqlite3 shell), then --resume continues the run"
                    )
                    raise JournalLocked(self.failure) from None
                if self._clock() - warned_at >= self.warn_every_s:
                    warned_at = self._clock()
                    log.warning(
                        "the journal %s is locked by another process (a backup, an sqlite3 shell, a slow disk?): "
                        "waiting %.0f s so far to %s%s",
                        self.path,
                        waited,
                        what,
                        "" if self.give_up_s is None else f"; the run fails after {self.give_up_s:.0f} s",
                    )
                self._sleep(delay)
                delay = min(2 * delay, 1.0)

    def raise_if_failed(self) -> None:
        """Raise JournalLocked if a lock outlasted `give_up_s` (the journal is then behind the run)."""
        if self.failure is not None:
            raise JournalLocked(self.failure)

    # Writes are buffered and flushed by `commit()`, so one scheduler call is one transaction.
    def set_state(self, key: str, value: Any) -> None:
        self._pending_state[key] = value

    def put_row(self, row_id: int, status: str, submit_version: int, attempts: int, step: int, trained: int) -> None:
        if status not in ROW_STATUSES:
            raise ValueError(f"unknown row status {status!r}")
        self._pending_rows[row_id] = (status, submit_version, attempts, step, trained)

    def commit(self) -> None:
        """Write the buffered changes in one transaction (waiting out another process's lock: `_retry`)."""
        if not self._pending_state and not self._pending_rows:
            return
        self._retry("commit", self._write_pending)
        self._pending_state.clear()
        self._pending_rows.clear()

    def _write_pending(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")  # the write lock now, not at COMMIT: a busy one is retried whole
        try:
            self._db.executemany(
                "INSERT INTO state(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                [(k, json.dumps(v)) for k, v in self._pending_state.items()],
            )
            self._db.executemany(
                "INSERT INTO rows(row_id, status, submit_version, attempts, step, trained_count)"
                " VALUES(?, ?, ?, ?, ?, ?) ON CONFLICT(row_id) DO UPDATE SET status=excluded.status,"
                " submit_version=excluded.submit_version, attempts=excluded.attempts, step=excluded.step,"
                " trained_count=excluded.trained_count",
                [(rid, *vals) for rid, vals in self._pending_rows.items()],
            )
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def state(self) -> dict[str, Any]:
        rows = self._retry("read its state", lambda: self._db.execute("SELECT key, value FROM state").fetchall())
        return {k: json.loads(v) for k, v in rows}

    def rows(self) -> dict[int, dict[str, int | str]]:
        """Every row's ledger line (tests and tools: a long run has one per row occurrence)."""
        return self._select("")

    def open_rows(self) -> dict[int, dict[str, int | str]]:
        """The rows not closed (trained, rejected or failed): what a resumed controller puts back in its queue."""
        marks = ", ".join("?" * len(CLOSED_STATUSES))
        return self._select(f"WHERE status NOT IN ({marks})", CLOSED_STATUSES)

    def rows_to_align(self, trainer_version: int) -> dict[int, dict[str, int | str]]:
        """The rows `RowScheduler.align_to_trainer` may move: queued ones, and trained ones of steps after
        `trainer_version`."""
        return self._select("WHERE status = 'queued' OR (status = 'trained' AND step > ?)", (trainer_version,))

    def _select(self, where: str, params: tuple[Any, ...] = ()) -> dict[int, dict[str, int | str]]:
        query = (
            f"SELECT row_id, status, submit_version, attempts, step, trained_count FROM rows {where} ORDER BY row_id"
        )
        rows = self._retry("read its rows", lambda: self._db.execute(query, params).fetchall())
        return {
            r[0]: {"status": r[1], "submit_version": r[2], "attempts": r[3], "step": r[4], "trained_count": r[5]}
            for r in rows
        }

    def close(self) -> None:
        try:
            if self.failure is None:
                self.commit()
        finally:
            with self._lock:
                self._db.close()
