"""The trainer service in-process (create_server with a prebuilt trainer): without a coordinator it trains a
step whenever P groups have arrived, reports each version through the version-ready hook, and Publish /
SaveCheckpoint work over gRPC."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetrl.group_stream import GroupSender
from fleetrl.rpc import open_channel
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.server import create_server
from fleetrl.trainer import PolicyTrainer
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from fleetrl.weights import fetch_weights
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = pytest.mark.integration


async def test_auto_steps_hook_publish_and_checkpoint(tiny_model_dir, tmp_path):
    run = make_cfg(tiny_model_dir, tmp_path, max_steps=2, weight_sync_interval=1)
    config = TrainerServiceConfig(
        run=run,
        grpc_port=0,
        groups_port=0,
        weights_port=0,
        metrics_port=None,
        auto_steps=True,
        record_groups=str(tmp_path / "recorded.jsonl"),
    )
    service = create_server(config, PolicyTrainer(run))
    ready: list[int] = []
    service.version_ready_hooks.append(ready.append)
    await service.start()
    try:
        with GroupSender(service.groups_address) as sender:
            for group in tiny_groups(tiny_model_dir, num_groups=5):
                sender.send(group)
        for _ in range(600):
            if service.trainer.version == 2 and service.auto_steps is not None and not service.auto_steps.is_alive():
                break
            await asyncio.sleep(0.05)
        service.check()
        assert service.trainer.version == 2 and ready == [1, 2]  # max_steps reached: the 5th group waits
        assert len(service.buffer) == 1
        assert (tmp_path / "final" / "model.safetensors").exists()  # auto mode finishes at max_steps
        assert len((tmp_path / "recorded.jsonl").read_text().splitlines()) == 5

        channel = open_channel(f"127.0.0.1:{service.grpc_port}")
        stub = trainer_pb2_grpc.TrainerStub(channel)
        published = await stub.Publish(trainer_pb2.PublishRequest(), timeout=30)
        saved = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(data_position='{"cursor": 4}'), timeout=30)
        await channel.close()
        assert published.version == 2 and published.weights_address == service.weights_address
        manifest, tensors = await asyncio.to_thread(fetch_weights, service.weights_address, 2, timeout_s=30)
        assert manifest.checksum == published.checksum
        assert published.weights_bytes == manifest.total_bytes  # the controller's push deadline scales with them
        assert set(tensors) == set(service.trainer.model.state_dict())
        state = json.loads((tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
        assert saved.version == 2 and state["data_position"] == {"cursor": 4}
    finally:
        await service.stop()
