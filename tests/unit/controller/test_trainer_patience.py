"""A trainer that stops answering for a while (a long garbage-collection pause, a slow checkpoint write, a busy host:
SIGSTOP in the probe) is waited for, with a warning, up to `trainer_patience_s`; the run fails only when that
patience is spent or the trainer is gone (issue 28, item 7). Before, a trainer silent for heartbeat_timeout_s
(30 s; the probe's SIGSTOP of 45 s) failed the run at once: "no live trainer registered".

A real gRPC trainer stand-in answers Finish; the controller's clock is the test's, so "silent for 100 s" is a number.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunFailed
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from tests.waiting import async_wait_until


class Trainer(trainer_pb2_grpc.TrainerServicer):
    async def Finish(self, request, context):
        return trainer_pb2.FinishResponse(version=3, export_path="/run/final")


async def setup(tmp_path, patience_s: float = 600.0):
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(Trainer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    now = [1000.0]
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("trainer", "trainer", f"127.0.0.1:{port}", now[0])
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", trainer_patience_s=patience_s)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: now[0])
    return server, orch, now


async def test_a_silent_trainer_is_waited_for_with_a_warning_and_the_run_goes_on(tmp_path, caplog):
    server, orch, now = await setup(tmp_path)
    try:
        now[0] += 100  # 100 s without an answer to Status: past heartbeat_timeout_s (30 s)
        orch.members.missed_poll("trainer", "DEADLINE_EXCEEDED")  # a paused process: calls time out
        with caplog.at_level(logging.WARNING):
            finish = asyncio.create_task(orch.finish())
            await async_wait_until(lambda: orch.trainer_waits > 0, 10, "the controller waiting for the trainer")
        assert not finish.done()  # before: RunFailed("no live trainer registered") at once
        assert "has not answered for 100 s" in caplog.text and "trainer_patience_s" in caplog.text
        orch.members.answered_poll("trainer", now[0])  # it answers again (SIGCONT)
        await asyncio.wait_for(finish, 10)
        assert orch.export_path == "/run/final"
    finally:
        await orch.close()
        await server.stop(None)


async def test_the_run_fails_once_the_patience_is_spent(tmp_path):
    server, orch, now = await setup(tmp_path, patience_s=300)
    try:
        now[0] += 100
        orch.members.missed_poll("trainer", "DEADLINE_EXCEEDED")
        finish = asyncio.create_task(orch.finish())
        await async_wait_until(lambda: orch.trainer_waits > 0, 10, "the controller waiting for the trainer")
        now[0] += 301
        with pytest.raises(RunFailed, match=r"did not answer for 401 s \(trainer_patience_s 300"):
            await asyncio.wait_for(finish, 10)
    finally:
        await orch.close()
        await server.stop(None)


async def test_a_trainer_that_is_gone_fails_the_run_at_once(tmp_path):
    server, orch, now = await setup(tmp_path)
    try:
        now[0] += 100
        orch.members.missed_poll("trainer", "UNAVAILABLE")  # nothing listens at its address: the process exited
        with pytest.raises(RunFailed, match="is gone"):
            await asyncio.wait_for(orch.finish(), 10)
    finally:
        await orch.close()
        await server.stop(None)
