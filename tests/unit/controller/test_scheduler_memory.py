"""The controller's memory holds the rows in flight, not every row of the run (issue 18: a long run on a large
dataset keeps the controller's memory flat): a row's attempt count goes once the row is closed."""

from __future__ import annotations

import pytest

from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.scheduler import RowScheduler

ROWS = [{"q": i} for i in range(50)]


def _scheduler(journal: Journal | None = None, epochs: int = 40) -> RowScheduler:
    cursor = DatasetCursor(ROWS, epochs=epochs, shuffle=False)
    return RowScheduler(cursor, OffPolicyGate(4, 2, 1), prompt_groups_per_step=4, max_attempts=2, journal=journal)


def _run(scheduler: RowScheduler, outcome_of) -> int:
    """Lease, report, train and publish until the data is used up; returns the most attempt counts held."""
    version, most = 0, 0
    while not scheduler.finished():
        leases = scheduler.lease("gw", 8, 0.0)
        for lease in leases:
            scheduler.report(lease.row_id, outcome_of(lease), 0.0, gateway_id="gw", attempt=lease.attempt)
        while (step := scheduler.take_step()) is not None:
            scheduler.step_trained(step)
            version += 1
            scheduler.publish(version)
        most = max(most, len(scheduler.attempts))
        assert leases or scheduler.finished(), "the run stalled"
    return most


def test_a_long_run_holds_attempt_counts_for_rows_in_flight_only():
    scheduler = _scheduler()
    most = _run(scheduler, lambda lease: "accepted")
    assert scheduler.counters["rows_accepted"] == 2000
    assert most <= 16 and not scheduler.attempts  # the gate's window at most; none at the end


@pytest.mark.parametrize("outcome", ["rejected", "failed"])
def test_rejected_and_failed_rows_are_closed_too(outcome):
    scheduler = _scheduler(epochs=2)
    _run(scheduler, lambda lease: outcome if lease.row_id % 3 == 0 else "accepted")
    assert not scheduler.attempts


def test_the_journal_keeps_the_attempts_of_closed_rows_and_a_resume_loads_open_rows_only(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    scheduler = _scheduler(journal, epochs=1)
    _run(scheduler, lambda lease: "failed" if lease.row_id == 7 and lease.attempt == 1 else "accepted")
    rows = journal.rows()
    assert rows[7]["status"] == "trained" and rows[7]["attempts"] == 2  # retried once, then trained
    assert all(info["status"] == "trained" for info in rows.values()) and not scheduler.attempts
    resumed = RowScheduler.resume(
        journal,
        ROWS,
        lambda version: OffPolicyGate(4, 2, 1, version=version),
        {"epochs": 1, "shuffle": False},
        prompt_groups_per_step=4,
    )
    assert not resumed.attempts and not resumed.queue
    journal.close()


def test_the_journal_selects_open_rows_and_rows_to_align_without_reading_every_row(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    lines = {
        1: ("trained", 3),
        2: ("trained", 5),
        3: ("rejected", -1),
        4: ("failed", -1),
        5: ("queued", 4),
        6: ("leased", -1),
        7: ("accepted", -1),
        8: ("assigned", 6),
    }
    for row_id, (status, step) in lines.items():
        journal.put_row(row_id, status, 0, 1, step, int(status == "trained"))
    journal.commit()
    assert set(journal.open_rows()) == {5, 6, 7, 8}
    assert set(journal.rows_to_align(4)) == {2, 5}  # trained after step 4, and every queued row
    assert set(journal.rows_to_align(5)) == {5}
    assert set(journal.rows()) == set(lines)
    journal.close()
