"""A controller that stops without finishing the run (a failure, a signal) tells gateways `run_stopped`, not
`run_finished` (issue 28, item 2): before, `Orchestrator.run` set `finished` in a `finally` and every gateway was
told the run had finished and exited 0, so a controller restarted under compose (`restart: on-failure`) resumed
with no gateway left.

The servicer is called directly, with the orchestrator whose run loop really ended (no trainer answers: RunFailed).
"""

from __future__ import annotations

import asyncio

import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunFailed, RunStopped
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2
from tests.unit.controller.test_lease_hold import Context


def make(tmp_path) -> tuple[ControllerServicer, Orchestrator]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", start_timeout_s=0.05, heartbeat_interval_s=0.05)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl")
    servicer = ControllerServicer(scheduler, members, orch, run_id="r", heartbeat_interval_s=0.05)
    return servicer, orch


def replies(servicer):
    heartbeat = asyncio.run(servicer.Heartbeat(controller_pb2.HeartbeatRequest(member_id="gw"), Context()))
    lease = asyncio.run(servicer.LeaseRows(controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=1), Context()))
    return heartbeat, lease


def test_a_failed_run_tells_gateways_it_stopped_not_that_it_finished(tmp_path):
    servicer, orch = make(tmp_path)
    with pytest.raises(RunFailed, match="no trainer"):
        asyncio.run(orch.run())
    for reply in replies(servicer):
        assert not reply.run_finished and reply.run_stopped  # before: run_finished
    assert "gw" in orch.told_finished  # the controller may stop once they were told


def test_a_stopped_run_tells_gateways_it_stopped(tmp_path):
    servicer, orch = make(tmp_path)
    orch.request_stop()

    async def run():
        orch.wait_for_members = _started  # the run starts, then the stop ends it after no step
        await orch.run()

    async def _started():
        return None

    with pytest.raises(RunStopped):
        asyncio.run(run())
    for reply in replies(servicer):
        assert not reply.run_finished and reply.run_stopped


def test_a_finished_run_says_finished(tmp_path):
    servicer, orch = make(tmp_path)
    orch.finished = orch.completed = True  # what run() leaves after finish() returned
    for reply in replies(servicer):
        assert reply.run_finished and not reply.run_stopped


def test_the_end_record_says_how_the_run_ended(tmp_path):
    _, orch = make(tmp_path)
    with pytest.raises(RunFailed):
        asyncio.run(orch.run())
    record = orch.end_record()
    assert record["outcome"] == "failed" and "no trainer" in record["error"]
    assert record["trained_steps"] == 0 and record["version"] == 0 and record["final_model"] is None
    assert record["rows_dropped_slow"] == 0 and record["rows_dropped_failing"] == 0
