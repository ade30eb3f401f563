"""A run whose journal another process locks (issue 45): while a second connection (a backup, an admin's
`sqlite3` shell) held a write lock on `controller.sqlite`, `ReportRows` and the scheduler's requeue commit raised
`database is locked` and the run failed with a traceback. Now the controller warns while it waits and goes on
once the lock is released, every step trained once; a lock held past stall_timeout_s fails the run with that
reason (exit 1, the reason on the console)."""

from __future__ import annotations

import re
import sqlite3

import pytest

from fleetrl.controller.journal import Journal
from tests.integration.up.conftest import read_metrics, start_fleetrl_up, wait_for_steps, write_run
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def hold_journal(run_dir):
    """Another connection holding the journal's write lock (BEGIN IMMEDIATE) until it commits."""
    db = sqlite3.connect(run_dir / "controller.sqlite", isolation_level=None, timeout=30)
    db.execute("BEGIN IMMEDIATE")
    return db


def config_for(tmp_path, tiny_model_dir, controller_args=()):
    return write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 5, "rollout_extras": {"tool_latency_s": 0.2}},
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn", "controller_args": list(controller_args)},
        n_rows=40,
    )


def test_the_run_waits_out_a_journal_lock_warning_and_goes_on(tmp_path, tiny_model_dir):
    config = config_for(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        db = hold_journal(run_dir)
        try:
            controller_log = run_dir / "controller.log"
            # Held as long as in the probe (20 s): until the controller says it has waited that long.
            waited_20s = re.compile(r"waiting ([2-9]\d|\d{3,}) s so far")
            wait_until(
                lambda: waited_20s.search(controller_log.read_text()) or proc.poll() is not None, 180, "a 20 s wait"
            )
            assert proc.poll() is None, "the run ended while the journal was locked"
        finally:
            db.execute("COMMIT")
            db.close()
        _, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in ledger.items() if info["status"] == "trained"]
    assert len(trained) == 10 and all(ledger[r]["trained_count"] == 1 for r in trained)


def test_a_journal_lock_held_past_the_stall_timeout_fails_the_run_with_the_reason(tmp_path, tiny_model_dir):
    config = config_for(tmp_path, tiny_model_dir, ["--stall-timeout", "20"])
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 1)
        db = hold_journal(run_dir)
        try:
            _, err = proc.communicate(timeout=400)  # the lock is held until the run has ended
        finally:
            db.execute("ROLLBACK")
            db.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "the run failed: JournalLocked: the journal" in err and "stayed locked by another process" in err, err
    assert "Traceback" not in err.split("--- last lines of")[0]
