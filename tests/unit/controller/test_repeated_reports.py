"""A gateway sends a report again when the controller's reply was lost (issue 28, item 1): the controller must treat
a repeat as a no-op. And a late or foreign report (another gateway's row, an older attempt, a repeat) changes no
counter, `samples_dropped_*` included (item 3: they used to be added whatever the report was).

The servicer is called directly, with the scheduler, registry and orchestrator it runs with.
"""

from __future__ import annotations

import asyncio

from fleetrl.v1 import controller_pb2
from tests.unit.controller.test_lease_hold import Context, lease, make


def report_rows(servicer, *reports, gateway_id="gw"):
    request = controller_pb2.ReportRowsRequest(gateway_id=gateway_id, reports=list(reports))
    return list(asyncio.run(servicer.ReportRows(request, Context())).results)


def row_report(row, outcome, **kw):
    return controller_pb2.RowReport(row_id=row.row_id, attempt=row.attempt, outcome=outcome, **kw)


def test_an_accepted_report_sent_twice_is_applied_once(tmp_path):
    servicer, orch = make(tmp_path)
    orch.started = True
    row = lease(servicer).rows[0]
    report = row_report(row, controller_pb2.ACCEPTED, samples=2, samples_dropped={"error": 1}, min_version=0)
    assert report_rows(servicer, report) == ["accepted"]
    before = dict(servicer.scheduler.counters)
    pending = list(servicer.scheduler.pending)
    assert report_rows(servicer, report) == ["late"]
    after = dict(servicer.scheduler.counters)
    assert after.pop("late_reports") == before.pop("late_reports") + 1
    assert after == before  # rows_accepted and samples_dropped_error counted once
    assert servicer.scheduler.pending == pending  # the group joins one step, once


def test_a_rejected_or_failed_report_sent_twice_is_applied_once(tmp_path):
    servicer, orch = make(tmp_path)
    orch.started = True
    rejected, failed = lease(servicer).rows[:2]
    reject = row_report(rejected, controller_pb2.REJECTED, samples_dropped={"too_long": 2}, rewards=[1.0, 1.0])
    fail = row_report(failed, controller_pb2.FAILED, reason="send timed out")
    assert report_rows(servicer, reject, fail) == ["rejected", "retry"]
    counters = dict(servicer.scheduler.counters)
    queue = list(servicer.scheduler.queue)
    assert report_rows(servicer, reject, fail) == ["late", "late"]
    assert servicer.scheduler.counters["samples_dropped_too_long"] == counters["samples_dropped_too_long"] == 2
    assert servicer.scheduler.counters["rows_rejected"] == counters["rows_rejected"] == 1
    assert servicer.scheduler.counters["rows_requeued_failed"] == counters["rows_requeued_failed"] == 1
    assert list(servicer.scheduler.queue) == queue  # the failed row queued once
    assert orch._rejected_groups == 1


def test_a_foreign_or_old_attempts_report_adds_to_no_drop_counter(tmp_path):
    servicer, orch = make(tmp_path)
    orch.started = True
    row = lease(servicer).rows[0]
    foreign = row_report(row, controller_pb2.REJECTED, samples_dropped={"error": 5})
    assert report_rows(servicer, foreign, gateway_id="other") == ["late"]
    old = controller_pb2.RowReport(
        row_id=row.row_id, attempt=row.attempt + 7, outcome=controller_pb2.REJECTED, samples_dropped={"error": 3}
    )
    assert report_rows(servicer, old) == ["late"]
    assert servicer.scheduler.counters.get("samples_dropped_error", 0) == 0  # before: 8


def test_an_evaluation_reported_twice_writes_one_line(tmp_path):
    servicer, _ = make(tmp_path, evaluation=True)
    request = controller_pb2.ReportEvalRequest(version=0, metrics={"accuracy": 0.5}, gateway_id="gw")
    asyncio.run(servicer.ReportEval(request, Context()))
    asyncio.run(servicer.ReportEval(request, Context()))
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"eval/accuracy": 0.5' in lines[0]
