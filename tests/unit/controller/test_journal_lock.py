"""The controller's journal under another process's lock, and a damaged journal (issue 45).

While another process held a write lock on `controller.sqlite` (a backup, an admin's `sqlite3` shell), a commit
raised `sqlite3.OperationalError: database is locked` and the run failed with a traceback. Now every statement
waits with backoff, warning while it waits, and goes on once the lock is released; a lock held past the give-up
time (the controller's stall_timeout_s) raises JournalLocked with the reason, and the journal stays failed. A
damaged file is refused with one line naming it. The lock is held by a real second connection in another
process."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import threading
import time

import pytest

from fleetrl.controller.journal import Journal, JournalDamaged, JournalLocked, check_journal

HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO state(key, value) VALUES('held', '1') ON CONFLICT(key) DO UPDATE SET value='1'")
print("locked", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
print("released", flush=True)
"""


class LockHolder:
    """Another process holding the journal's write lock until `release()`."""

    def __init__(self, path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "locked"

    def release(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"
        self.proc.wait(timeout=30)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_commit_waits_out_another_process_lock_warning_and_then_goes_on(tmp_path, caplog):
    path = tmp_path / "controller.sqlite"
    journal = Journal(path, give_up_s=600.0, busy_timeout_s=0.05, warn_every_s=0.0)
    holder = LockHolder(path)
    errors = []
    try:
        journal.set_state("version", 3)
        journal.put_row(7, "trained", 2, 1, 3, 1)
        with caplog.at_level(logging.WARNING, logger="fleetrl.controller.journal"):
            writer = threading.Thread(target=lambda: _commit(journal, errors), daemon=True)
            writer.start()
            wait_until(lambda: any("is locked by another process" in r.getMessage() for r in caplog.records))
            assert writer.is_alive()  # still waiting: the lock is held
            holder.release()
            writer.join(timeout=60)
        assert not writer.is_alive() and errors == []
    finally:
        holder.kill()
    warning = next(r.getMessage() for r in caplog.records if "is locked by another process" in r.getMessage())
    assert str(path) in warning and "the run fails after 600 s" in warning
    assert journal.state() == {"held": 1, "version": 3} and journal.rows()[7]["step"] == 3
    journal.close()


def _commit(journal, errors):
    try:
        journal.commit()
    except Exception as exc:  # reported to the test thread
        errors.append(exc)


def test_a_lock_held_past_the_give_up_time_fails_with_the_reason_and_stays_failed(tmp_path):
    path = tmp_path / "controller.sqlite"
    ticks = itertools.count(step=7.0)  # each look at the clock: 7 s later (no waiting on the wall clock)
    journal = Journal(path, give_up_s=30.0, busy_timeout_s=0.01, clock=lambda: next(ticks), sleep=lambda _s: None)
    holder = LockHolder(path)
    try:
        journal.set_state("version", 1)
        with pytest.raises(JournalLocked) as failed:
            journal.commit()
        message = str(failed.value)
        assert str(path) in message and "stayed locked by another process" in message
        assert "stall_timeout_s 30" in message and "database is locked" in message
        holder.release()
        with pytest.raises(JournalLocked):  # behind the run now: every later use says so
            journal.raise_if_failed()
        with pytest.raises(JournalLocked):
            journal.commit()
    finally:
        holder.kill()
    journal.close()  # closes without writing


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b"garbage!" * 100 + p.read_bytes()[800:]),  # the header overwritten
        lambda p: p.write_bytes(b""),  # empty: a database without the journal's tables
        lambda p: p.write_bytes(p.read_bytes()[:1500]),  # truncated mid-page
    ],
    ids=["header", "empty", "truncated"],
)
def test_a_damaged_journal_is_refused_in_one_line_naming_it(tmp_path, damage):
    path = tmp_path / "controller.sqlite"
    journal = Journal(path)
    for row_id in range(200):
        journal.put_row(row_id, "trained", 0, 1, 1 + row_id // 2, 1)
    journal.set_state("version", 100)
    journal.close()
    check_journal(path)  # sound
    damage(path)
    with pytest.raises(JournalDamaged) as refused:
        check_journal(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_a_sound_journal_is_not_refused_while_locked_or_after_a_crash_mid_transaction(tmp_path):
    path = tmp_path / "controller.sqlite"
    journal = Journal(path)
    journal.set_state("version", 1)
    journal.commit()
    holder = LockHolder(path)  # an admin's shell holding the lock: the controller will wait it out
    try:
        check_journal(path)
    finally:
        holder.kill()  # killed mid-transaction, as a crashed controller leaves its WAL
    check_journal(path)
    assert Journal(path).state() == {"version": 1}


def test_journal_opening_a_file_that_is_not_a_database_says_so(tmp_path):
    path = tmp_path / "controller.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(JournalDamaged, match="is damaged"):
        Journal(path)


def test_fleetrl_up_resume_refuses_a_damaged_journal_before_anything_starts(tmp_path, capsys):
    import json

    from fleetrl.up.run import main

    log_dir = tmp_path / "run"
    journal = Journal(log_dir / "controller.sqlite")
    journal.set_state("version", 4)
    journal.close()
    (log_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    header = (log_dir / "controller.sqlite").read_bytes()
    (log_dir / "controller.sqlite").write_bytes(bytes(100) + header[100:])
    config = tmp_path / "run.json"
    (tmp_path / "rollout.py").write_text("def make(setup):\n    return None\n")
    config.write_text(
        json.dumps({"run": {"base_model": "m", "log_path": str(log_dir)}, "up": {"rollout": "rollout.py:make"}})
    )
    assert main([str(config), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"fleetrl up: --resume: the journal {log_dir / 'controller.sqlite'}")
    assert "--overwrite would discard" in err and str(log_dir / "metrics.jsonl") in err
    assert not list(log_dir.glob("*.log"))  # no service started
