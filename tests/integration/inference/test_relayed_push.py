"""Relayed weight pushes, controller to replicas: real inference servers (hf engine, tiny model) on loopback, a
real weight publisher as the trainer's, and the controller's Orchestrator pushing with weight_fanout "chain" or
"tree". The trainer sends one copy per version; a replica that joins fetches from a peer's relay; a dead middle
replica does not wedge the push (the one behind it loads from the trainer)."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoModelForCausalLM

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.rpc import open_channel
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.services.inference.server import InferenceService, create_server
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights import WeightPublisher

pytestmark = pytest.mark.integration

TOKEN = "relay-token"


async def start_replica(model_dir: str) -> InferenceService:
    config = InferenceConfig(
        model=model_dir,
        engine="hf",
        grpc_port=0,
        http_port=None,
        metrics_port=None,
        auth_token=TOKEN,
        relay_timeout_s=3.0,  # a relay whose upstream is gone fails within this (then: from the trainer)
    )
    service = create_server(config, HFEngine(model_dir))
    await service.start()
    return service


async def status(service: InferenceService) -> inference_pb2.StatusResponse:
    async with open_channel(f"127.0.0.1:{service.grpc_port}", auth_token=TOKEN) as channel:
        return await inference_pb2_grpc.InferenceStub(channel).Status(inference_pb2.StatusRequest(), timeout=10)


def orchestrator(tmp_path, fanout: str, replicas: list[InferenceService]) -> Orchestrator:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=60)
    for i, service in enumerate(replicas):
        members.register("inference", f"inference-{i}", f"127.0.0.1:{service.grpc_port}", 0.0)
    config = ControllerConfig(
        run=Config(weight_fanout=fanout),
        rows_path="rows.jsonl",
        auth_token=TOKEN,
        heartbeat_interval_s=5.0,
        heartbeat_timeout_s=60.0,
        weight_push_timeout_s=60.0,
    )
    return Orchestrator(config, scheduler, members, metrics_path=tmp_path / "metrics.jsonl", clock=lambda: 1.0)


async def push(orch: Orchestrator, publisher: WeightPublisher, version: int, state: dict) -> str:
    manifest = publisher.publish(version, {k: v + 0.001 * version for k, v in state.items()})
    await orch.push_weights(version, publisher.address)
    orch.pushed_version = version
    return manifest.checksum


@pytest.fixture
async def replicas(tiny_model_dir):
    started: list[InferenceService] = []

    async def start(n: int) -> list[InferenceService]:
        new = [await start_replica(tiny_model_dir) for _ in range(n)]
        started.extend(new)
        return new

    yield start
    for service in started:
        await service.stop()


@pytest.mark.parametrize("fanout", ["chain", "tree"])
async def test_the_trainer_sends_one_copy_per_version_and_a_joining_replica_fetches_from_a_peer(
    tmp_path, tiny_model_dir, replicas, fanout, caplog
):
    caplog.set_level(logging.INFO, logger="fleetrl.services.controller.orchestrator")
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    services = await replicas(3)
    orch = orchestrator(tmp_path, fanout, services)
    with WeightPublisher(auth_token=TOKEN) as publisher:
        await orch.poll_members()  # the controller learns each replica's relay address from its Status
        relays = {s.relay.address for s in services}
        assert {m.relay_address for m in orch.members.members.values()} == relays
        for version in (1, 2, 3):
            checksum = await push(orch, publisher, version, state)
            for service in services:
                reply = await status(service)
                assert (reply.loaded_version, reply.loaded_checksum) == (version, checksum)
                assert reply.relay_version == version  # each holds the version for its peers
            assert len(orch.members.routable_replicas(1.0)) == 3
            counts = publisher.snapshot_counts()
            assert counts["bytes_served"] == version * model_bytes, counts  # one copy left the trainer per version
        loads = [r.getMessage() for r in caplog.records if "loaded version 3 from" in r.getMessage()]
        assert sum(publisher.address in line for line in loads) == 1 and len(loads) == 3, loads

        # A replica joining now fetches version 3 from a peer's relay: the trainer sends nothing more.
        (joined,) = await replicas(1)
        orch.members.register("inference", "inference-joined", f"127.0.0.1:{joined.grpc_port}", 1.0)
        await orch.poll_members()  # fenced (it serves version 0), and caught up in the background
        _, task = orch._loading["inference-joined"]
        await task
        reply = await status(joined)
        assert (reply.loaded_version, reply.loaded_checksum) == (3, checksum)
        assert not orch.members.members["inference-joined"].fenced
        assert publisher.snapshot_counts()["bytes_served"] == 3 * model_bytes
        (line,) = [r.getMessage() for r in caplog.records if "inference-joined loaded version 3" in r.getMessage()]
        assert any(address in line for address in relays), line


async def test_a_dead_middle_replica_does_not_wedge_the_push(tmp_path, tiny_model_dir, replicas, caplog):
    caplog.set_level(logging.INFO, logger="fleetrl.services.controller.orchestrator")
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    first, middle, last = await replicas(3)
    orch = orchestrator(tmp_path, "chain", [first, middle, last])
    with WeightPublisher(auth_token=TOKEN) as publisher:
        await orch.poll_members()
        await push(orch, publisher, 1, state)
        assert publisher.snapshot_counts()["bytes_served"] == model_bytes
        await middle.stop()  # its gRPC and its relay are gone; the controller has not noticed yet
        checksum = await push(orch, publisher, 2, state)
        for service in (first, last):
            assert (await status(service)).loaded_checksum == checksum
        assert [m.member_id for m in orch.members.routable_replicas(1.0)] == ["inference-0", "inference-2"]
        assert orch.members.members["inference-1"].fenced
        # The last replica's relayed load from the dead middle failed; it loaded from the trainer instead.
        assert publisher.snapshot_counts()["bytes_served"] == 3 * model_bytes
        messages = [r.getMessage() for r in caplog.records]
        assert any("inference-2 could not load version 2 relayed from" in m for m in messages)
        assert any(f"inference-2 loaded version 2 from {publisher.address}" in m for m in messages)
