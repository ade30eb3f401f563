"""Collective weight pushes (``weight_transport = "collective"``), controller to hf replicas: real inference servers
(hf engine, tiny model) on loopback, a real weight publisher as the trainer's, and the controller's Orchestrator
pushing. The trainer broadcasts each version to both replicas in one gloo group (no byte over the weight stream);
a group that breaks (a member claims its rank and never comes) makes every replica load the version over ZeroMQ
instead, and the version is still served. The vLLM engine's side: test_vllm_collective.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
from transformers import AutoModelForCausalLM

from fleetrl import Config
from fleetrl.clients.inference import InferenceClient
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.weights import WeightPublisher
from fleetrl.weights.collective import join_group, request_group
from tests.integration.inference.test_relayed_push import TOKEN, start_replica, status

pytestmark = pytest.mark.integration


def orchestrator(tmp_path, services) -> Orchestrator:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=60)
    for i, service in enumerate(services):
        members.register("inference", f"inference-{i}", f"127.0.0.1:{service.grpc_port}", 0.0)
    config = ControllerConfig(
        run=Config(weight_transport="collective"),
        rows_path="rows.jsonl",
        auth_token=TOKEN,
        heartbeat_interval_s=5.0,
        heartbeat_timeout_s=60.0,
        weight_push_timeout_s=60.0,
    )
    return Orchestrator(config, scheduler, members, metrics_path=tmp_path / "metrics.jsonl", clock=lambda: 1.0)


@pytest.fixture
async def two_replicas(tiny_model_dir):
    services = [await start_replica(tiny_model_dir) for _ in range(2)]
    yield services
    for service in services:
        await service.stop()


async def test_the_trainer_broadcasts_each_version_to_both_replicas_in_one_group(
    tmp_path, tiny_model_dir, two_replicas
):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    orch = orchestrator(tmp_path, two_replicas)
    with WeightPublisher(auth_token=TOKEN, collective_bucket_bytes=1 << 20) as publisher:
        await orch.poll_members()
        for version in (1, 2):
            manifest = publisher.publish(version, {k: v + 0.001 * version for k, v in state.items()})
            await orch.push_weights(version, publisher.address)
            orch.pushed_version = version
            for service in two_replicas:
                reply = await status(service)
                assert (reply.loaded_version, reply.loaded_checksum) == (version, manifest.checksum)
            sender = publisher.collective_senders[-1]
            assert sender.done.wait(30) and sender.error == ""
            assert sender.world_size == 3  # the trainer and both replicas, in the one group of this version
        assert len(publisher.collective_senders) == 2
        assert publisher.snapshot_counts().get("bytes_served", 0) == 0  # nothing went over the weight stream
        assert len(orch.members.routable_replicas(1.0)) == 2


async def test_a_broken_group_falls_back_to_the_stream_and_the_version_is_served(tiny_model_dir, two_replicas):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    with WeightPublisher(auth_token=TOKEN) as publisher:
        manifest = publisher.publish(1, {k: v + 0.5 for k, v in state.items()})
        # A third "replica" opens the group for three, claims its rank and never builds the group: the broadcast
        # cannot start, the group's wait times out, and both real replicas load the version over ZeroMQ.
        offer = request_group(publisher.address, 1, replicas=3, auth_token=TOKEN, timeout_s=3)
        ghost = threading.Thread(target=join_group, args=(offer, 1), daemon=True)
        ghost.start()

        async def load(service) -> object:
            async with InferenceClient(f"127.0.0.1:{service.grpc_port}", auth_token=TOKEN) as client:
                return await client.load_weights(1, publisher.address, timeout_s=3, group_replicas=3)

        results = await asyncio.gather(*(load(s) for s in two_replicas))
        ghost.join(30)
        assert [r.transport for r in results] == ["zmq", "zmq"]
        assert all(r.version == 1 and r.checksum == manifest.checksum for r in results)
        assert publisher.collective_senders[-1].error  # the trainer's side of the group failed too
        assert publisher.snapshot_counts()["bytes_served"] == 2 * model_bytes
