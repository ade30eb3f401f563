"""The controller's SQLite journal: version, cursor, step and counters, and one ledger line per row.

Every change the scheduler makes is written through here in a single transaction, so a restarted controller
resumes where it was. Row statuses: leased, accepted (waiting for a step), assigned (in step k), trained,
rejected, failed (gave up after repeated failures), queued (waiting to be leased again).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

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


class Journal:
    """A small key/value + row ledger store on SQLite (WAL mode, one writer)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._pending_state: dict[str, Any] = {}
        self._pending_rows: dict[int, tuple[str, int, int, int, int]] = {}

    # Writes are buffered and flushed by `commit()`, so one scheduler call is one transaction.
    def set_state(self, key: str, value: Any) -> None:
        self._pending_state[key] = value

    def put_row(self, row_id: int, status: str, submit_version: int, attempts: int, step: int, trained: int) -> None:
        if status not in ROW_STATUSES:
            raise ValueError(f"unknown row status {status!r}")
        self._pending_rows[row_id] = (status, submit_version, attempts, step, trained)

    def commit(self) -> None:
        if not self._pending_state and not self._pending_rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
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
                self._db.execute("ROLLBACK")
                raise
        self._pending_state.clear()
        self._pending_rows.clear()

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM state")}

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
        with self._lock:
            cursor = self._db.execute(
                "SELECT row_id, status, submit_version, attempts, step, trained_count FROM rows "
                f"{where} ORDER BY row_id",
                params,
            )
            return {
                r[0]: {"status": r[1], "submit_version": r[2], "attempts": r[3], "step": r[4], "trained_count": r[5]}
                for r in cursor
            }

    def close(self) -> None:
        self.commit()
        with self._lock:
            self._db.close()
