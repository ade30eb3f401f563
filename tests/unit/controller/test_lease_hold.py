"""No row is leased before the run has started (trainer and replica answered, a resumed version pushed, the start
evaluation done), and a replica that joins a running run takes no rollouts until it serves the current version.

The controller's servicer is called directly (no sockets), with the scheduler, registry and orchestrator it runs
with.
"""

from __future__ import annotations

import asyncio

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2

NOW = 1000.0


class Context:
    """What the servicer uses of grpc.aio.ServicerContext."""

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def make(tmp_path, evaluation: bool = False) -> tuple[ControllerServicer, Orchestrator]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("inference", "inference-0", "127.0.0.1:1", NOW)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", evaluation=evaluation)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: NOW)
    servicer = ControllerServicer(scheduler, members, orch, run_id="r", heartbeat_interval_s=2.0, clock=lambda: NOW)
    return servicer, orch


def lease(servicer: ControllerServicer) -> controller_pb2.LeaseRowsResponse:
    request = controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=4)
    return asyncio.run(servicer.LeaseRows(request, Context()))


def test_no_lease_before_the_run_has_started(tmp_path):
    servicer, orch = make(tmp_path)
    reply = lease(servicer)  # a routable replica, but the controller is still starting (e.g. pushing version c)
    assert list(reply.rows) == [] and reply.retry_after_s > 0
    orch.started = True
    assert len(lease(servicer).rows) == 4


def test_no_lease_while_the_start_evaluation_runs(tmp_path):
    servicer, orch = make(tmp_path, evaluation=True)
    orch.started = True
    reply = lease(servicer)
    assert list(reply.rows) == []
    assert [r.member_id for r in reply.replicas] == ["inference-0"]  # the evaluator can sample meanwhile
    orch.hold_leases = False  # version 0 evaluated
    assert len(lease(servicer).rows) == 4


def test_a_replica_joining_a_running_run_is_routable_only_once_it_serves_the_current_version(tmp_path):
    servicer, orch = make(tmp_path)
    orch.started, orch.pushed_version = True, 3
    servicer.members.loaded("inference-0", 3)
    register = controller_pb2.RegisterRequest(kind=controller_pb2.INFERENCE, member_id="late", address="127.0.0.1:2")
    asyncio.run(servicer.Register(register, Context()))
    assert [r.member_id for r in lease(servicer).replicas] == ["inference-0"]
    assert servicer.members.members["late"].fenced
    servicer.members.loaded("late", 3)  # the next push reached it
    assert sorted(r.member_id for r in lease(servicer).replicas) == ["inference-0", "late"]


def test_a_report_cannot_invent_or_decrease_drop_counters(tmp_path):
    servicer, orch = make(tmp_path)
    orch.started = True
    row = lease(servicer).rows[0]
    report = controller_pb2.RowReport(
        row_id=row.row_id,
        attempt=row.attempt,
        outcome=controller_pb2.REJECTED,
        samples_dropped={"bogus": 5, "none": -3, "error": 2},
    )
    request = controller_pb2.ReportRowsRequest(gateway_id="gw", reports=[report])
    asyncio.run(servicer.ReportRows(request, Context()))
    counters = servicer.scheduler.counters
    assert counters["samples_dropped_error"] == 2
    assert "samples_dropped_bogus" not in counters and "samples_dropped_none" not in counters
