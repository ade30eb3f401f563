"""A late Status reply from a replica's old process must not put its restarted successor back in rotation (issue 28
item 4): the successor serves the base model until it is pushed the current version. Push and catch-up already
checked that the member they started with is still the registered one; the poll did not."""

from __future__ import annotations

import asyncio

import grpc

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from tests.waiting import async_wait_until


class OldReplica(inference_pb2_grpc.InferenceServicer):
    """The old process: it answers Status late (while the test restarts the member), serving version 3."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def Status(self, request, context):
        self.asked.set()
        await self.answer.wait()
        return inference_pb2.StatusResponse(loaded_version=3)


async def test_a_late_reply_from_the_old_process_does_not_unfence_its_successor(tmp_path):
    replica = OldReplica()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    members = MemberRegistry(heartbeat_timeout_s=30)
    old = members.register("inference", "inference-0", f"127.0.0.1:{port}", now=0)
    members.fence("inference-0", "missed a push")  # the old process was behind: fenced, to be caught up
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", heartbeat_interval_s=20)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: 0.0)
    orch.pushed_version = 3
    try:
        poll = asyncio.create_task(orch._poll(old))
        await async_wait_until(replica.asked.is_set, 10, "the poll asking the old process")
        # The replica restarts meanwhile: a new process, same member id, another port, at the base model.
        new = members.register("inference", "inference-0", "127.0.0.1:1", now=1)
        members.fence("inference-0", "restarted at the base model")
        replica.answer.set()  # the old process's reply arrives late: "version 3"
        await asyncio.wait_for(poll, 10)
        assert members.members["inference-0"] is new
        assert new.fenced and new.version == 0  # before: loaded(3) put it back in rotation serving base weights
        assert [m.member_id for m in members.routable_replicas(now=1)] == []
    finally:
        await orch.close()
        await server.stop(None)


class SlowStatusReplica(inference_pb2_grpc.InferenceServicer):
    """A replica whose Status reply is held (it was read before the swap: "version 3") while a push to version 4
    lands."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()

    async def Status(self, request, context):
        self.asked.set()
        await self.answer.wait()
        return inference_pb2.StatusResponse(loaded_version=3)

    async def LoadWeights(self, request, context):
        return inference_pb2.LoadWeightsResponse(version=request.version)


async def test_a_status_reply_sent_before_a_push_landed_does_not_fence_the_replica(tmp_path):
    replica = SlowStatusReplica()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    members = MemberRegistry(heartbeat_timeout_s=30)
    member = members.register("inference", "inference-0", f"127.0.0.1:{port}", now=0)
    members.loaded("inference-0", 3)
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", heartbeat_interval_s=20)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: 0.0)
    orch.pushed_version = 3
    try:
        poll = asyncio.create_task(orch._poll(member))
        await async_wait_until(replica.asked.is_set, 10, "the poll asking the replica")
        await orch.push_weights(4, "127.0.0.1:1")  # lands while the Status reply is on its way
        assert (member.version, member.fenced, orch.pushed_version) == (4, False, 4)
        replica.answer.set()  # "version 3": true when it was sent, stale now
        await asyncio.wait_for(poll, 10)
        # Before: fenced ("serves version 3") and pushed version 4 again in the background.
        assert not member.fenced and member.version == 4
        assert orch._loading["inference-0"][1].get_name() == "push-inference-0"  # no catch-up started
    finally:
        await orch.close()
        await server.stop(None)
