"""Liveness you can see (issue 45, item 5): while a TrainStep is out and the trainer has stopped answering Status
(SIGSTOP 45 s in the probe), the controller warns every few seconds naming the trainer and how long it has been
silent. Before, nothing was logged until the trainer resumed.

A real gRPC trainer stand-in holds TrainStep until the test releases it; the controller's clock and the watchdog's
wake-ups are the test's, so "silent for 12 s" is a number and no test sleeps.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.liveness import OverdueCall, watch_call
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from tests.waiting import async_wait_until


def test_a_silent_peer_is_warned_about_every_every_s_and_a_busy_one_is_not():
    rule = OverdueCall("TrainStep(step 3)", "the trainer at t:1", started=100, quiet_s=6, every_s=6)
    assert rule.due(now=150, silent_s=2) is None  # a long step, but the trainer answers Status: no warning
    first = rule.due(now=156, silent_s=6)
    assert first is not None and "the trainer at t:1" in first and "TrainStep(step 3)" in first
    assert "no reply after 56 s" in first and "has not answered Status for 6 s" in first
    assert rule.due(now=161, silent_s=11) is None  # not again before every_s
    assert "for 12 s" in (rule.due(now=162, silent_s=12) or "")
    assert rule.due(now=163, silent_s=0) is None and rule.warnings == 2  # it answers again
    assert rule.due(now=169, silent_s=6) is not None  # silent again: warned at once
    with pytest.raises(ValueError, match="must be > 0"):
        OverdueCall("x", "y", 0, quiet_s=0, every_s=1)


async def test_watch_call_returns_the_calls_result_and_stops_watching():
    ticks: asyncio.Queue[None] = asyncio.Queue()
    rule = OverdueCall("call", "peer", started=0, quiet_s=1, every_s=1)

    async def answer() -> str:
        return "done"

    assert await watch_call(answer(), rule, clock=lambda: 0.0, silent_s=lambda: 0.0, tick=ticks.get) == "done"


class StoppedTrainer(trainer_pb2_grpc.TrainerServicer):
    """TrainStep is received, then nothing (a SIGSTOPped process) until `resume` is set."""

    def __init__(self) -> None:
        self.received = asyncio.Event()
        self.resume = asyncio.Event()

    async def TrainStep(self, request, context):
        self.received.set()
        await self.resume.wait()
        return trainer_pb2.TrainStepResponse(version=request.step, published=False)


async def test_a_train_step_to_a_stopped_trainer_is_warned_about_every_few_seconds(tmp_path, caplog):
    trainer = StoppedTrainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    now = [1000.0]
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("trainer", "trainer", f"127.0.0.1:{port}", now[0])
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", heartbeat_interval_s=2)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: now[0])
    ticks: asyncio.Queue[None] = asyncio.Queue()
    orch.liveness_tick = ticks.get  # the watchdog wakes when the test says, not on a timer
    for lease in scheduler.lease("gw", 2, now=0):
        scheduler.report(lease.row_id, "accepted", now=1, min_version=0, attempt=lease.attempt)
    try:
        with caplog.at_level(logging.WARNING, logger="fleetrl.controller.liveness"):
            step = asyncio.create_task(orch.train_and_publish(scheduler.take_step()))
            await asyncio.wait_for(trainer.received.wait(), 10)  # the trainer is stopped inside TrainStep

            async def tick_at(t: float) -> list[str]:
                now[0] = t
                seen = len(caplog.records)
                ticks.put_nowait(None)
                # It takes the tick and judges it in one step of its task: once the queue is empty, it has logged.
                await async_wait_until(ticks.empty, 10, "the watchdog taking the tick")
                return [r.getMessage() for r in caplog.records[seen:]]

            assert await tick_at(1004) == []  # 4 s silent: within two polls, no warning
            (first,) = await tick_at(1006)
            assert f"the trainer at 127.0.0.1:{port}" in first and "TrainStep(step 1)" in first
            assert "has not answered Status for 6 s" in first
            (second,) = await tick_at(1045)
            assert "has not answered Status for 45 s" in second
            assert not step.done()
            trainer.resume.set()  # SIGCONT
            await asyncio.wait_for(step, 10)
        assert scheduler.trained_steps == 1
    finally:
        await orch.close()
        await server.stop(None)


def test_a_gateway_holding_rows_that_stops_heartbeating_is_warned_about_every_few_seconds(tmp_path, caplog):
    now = [0.0]
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("gateway", "gw-stopped", "", now[0])
    members.register("gateway", "gw-idle", "", now[0])  # silent too, but holds no rows: nothing to wait for
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", heartbeat_interval_s=2)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: now[0])
    leases = scheduler.lease("gw-stopped", 2, now=0)

    def warnings_at(t: float) -> list[str]:
        now[0] = t
        seen = len(caplog.records)
        orch.warn_silent_lease_holders()
        return [r.getMessage() for r in caplog.records[seen:]]

    with caplog.at_level(logging.WARNING, logger="fleetrl.controller.liveness"):
        assert warnings_at(4) == []  # two heartbeats missed at most: no warning
        (first,) = warnings_at(6)
        rows = ", ".join(str(lease.row_id) for lease in leases)
        assert f"gateway gw-stopped holds 2 leased rows [{rows}]" in first and "heartbeat for 6 s" in first
        assert warnings_at(10) == []  # not again before 6 s more
        assert "heartbeat for 12 s" in warnings_at(12)[0]
        members.heartbeat("gw-stopped", 13)  # it heartbeats again (SIGCONT)
        assert warnings_at(14) == []
