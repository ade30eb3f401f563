"""The controller keeps the run's record true: a run that trained nothing fails with the reason (counted per
rejected row by the servicer), a resume without a checkpoint is refused unless asked, and at a resume
metrics.jsonl is cut back to the trainer's version. The servicer and orchestrator are called directly."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.metrics_jsonl import SUPERSEDED, read_lines
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunFailed
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2

NOW = 1000.0


class Context:
    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def make(tmp_path, **kw) -> tuple[RowScheduler, Orchestrator]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    config = ControllerConfig(run=Config(max_seq_len=16, max_completion_tokens=8), rows_path="rows.jsonl", **kw)
    orch = Orchestrator(config, scheduler, MemberRegistry(30), metrics_path=tmp_path / "metrics.jsonl")
    return scheduler, orch


def test_rejected_rows_are_counted_by_cause_and_a_run_without_a_step_fails(tmp_path):
    scheduler, orch = make(tmp_path)
    servicer = ControllerServicer(scheduler, orch.members, orch, run_id="r", heartbeat_interval_s=2.0)
    reports = []
    while leases := scheduler.lease("gw", 4, NOW):
        for lease in leases:
            dropped = {"too_long": 2} if lease.row_id < 3 else {"none": 1, "error": 1}
            reports.append(
                controller_pb2.RowReport(
                    row_id=lease.row_id,
                    outcome=controller_pb2.REJECTED,
                    samples_dropped=dropped,
                    reason="only 0 valid samples (need 2)",
                    attempt=lease.attempt,
                )
            )
        request = controller_pb2.ReportRowsRequest(gateway_id="gw", reports=reports)
        asyncio.run(servicer.ReportRows(request, Context()))
        reports.clear()
    assert scheduler.finished()
    assert scheduler.counters["rows_rejected_too_long"] == 3 and scheduler.counters["rows_rejected_none"] == 1
    with pytest.raises(RunFailed) as failed:
        orch.check_trained()
    assert str(failed.value) == (
        "all 4 rows rejected: 3 too long for max_seq_len 16, 1 with rollouts returning None; nothing exported"
    )


def test_a_resume_whose_trainer_has_no_checkpoint_is_refused_unless_asked(tmp_path):
    scheduler, orch = make(tmp_path)
    scheduler.resumed, scheduler.trained_steps = True, 3
    with pytest.raises(RunFailed, match=r"no checkpoint to resume from .* 3 trained steps"):
        orch.check_resume_point(0)
    orch.check_resume_point(2)  # a checkpoint behind the journal: its later steps are trained again, as documented
    _, allowed = make(tmp_path, restart_weights=True)
    allowed.scheduler.resumed, allowed.scheduler.trained_steps = True, 3
    allowed.check_resume_point(0)


def test_at_a_resume_the_record_is_cut_back_to_the_trainers_version(tmp_path):
    scheduler, orch = make(tmp_path, evaluation=True)
    scheduler.resumed = True
    lines = [
        {"step": 0, "version": 0, "eval/accuracy": 0.1},
        *({"step": s, "version": s, "loss": 1.0 / s} for s in (1, 2, 3)),
        {"step": 2, "version": 2, "eval/accuracy": 0.2},
    ]
    orch.metrics_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    orch.cut_record(2)
    assert [(m["step"], "loss" in m) for m in read_lines(orch.metrics_path)] == [(0, 0), (1, 1), (2, 1), (2, 0)]
    assert [m["step"] for m in read_lines(tmp_path / SUPERSEDED)] == [3]
    assert orch.evaluated == {0: {"accuracy": 0.1}, 2: {"accuracy": 0.2}}  # not evaluated (and written) again
