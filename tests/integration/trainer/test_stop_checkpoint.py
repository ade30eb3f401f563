"""The trainer stopped by a signal checkpoints its last trained step (so `--resume` loses nothing), once, and only
after a step in flight has ended (or not at all when it does not end in time), and exits 0; a background failure
turns health NOT_SERVING and exits 1 without a checkpoint."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fleetrl.rpc import check_health, open_channel
from fleetrl.services.trainer.auto_steps import AutoSteps
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.server import create_server
from fleetrl.shell.service import EXIT_FAILED, EXIT_OK
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.checkpoint import checkpoint_path, latest_checkpoint
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = pytest.mark.integration


async def test_checkpoint_on_stop_saves_the_last_step_once(tiny_model_dir, tmp_path):
    run = make_cfg(tiny_model_dir, tmp_path, dcp_save_interval=0)
    config = TrainerServiceConfig(run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None)
    service = create_server(config, PolicyTrainer(run))
    try:
        root = service.trainer.checkpoint_dir
        assert service.checkpoint_on_stop(1.0) is None  # version 0: nothing trained, nothing to save
        service.trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2), step=1)
        assert latest_checkpoint(root) is None  # dcp_save_interval = 0: no periodic checkpoint

        # A step in flight holds the lock: the stop waits for it, and gives up when it does not end in time.
        service._lock.acquire()
        assert await asyncio.to_thread(service.checkpoint_on_stop, 0.2) is None
        release = threading.Timer(0.3, service._lock.release)
        release.start()
        saved = await asyncio.to_thread(service.checkpoint_on_stop, 60.0)
        assert saved == checkpoint_path(root, 1) and latest_checkpoint(root) == saved
        assert service.checkpoint_on_stop(1.0) is None  # already the latest: not saved again
    finally:
        await service.stop()


async def test_the_serving_life_checkpoints_at_a_stop_and_exits_0(tiny_model_dir, tmp_path):
    run = make_cfg(tiny_model_dir, tmp_path, dcp_save_interval=0)
    config = TrainerServiceConfig(run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None)
    service = create_server(config, PolicyTrainer(run))
    try:
        info = await service.start()
        # The ready file's keys, as `fleetrl up` reads them (the shell adds metrics_port when /metrics serves).
        assert set(info) == {"host", "grpc_port", "groups_address", "weights_address", "metrics_port", "world_size"}
        assert info["grpc_port"] == service.grpc_port and info["metrics_port"] is None
        service.trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2), step=1)
        stop = asyncio.Event()
        stop.set()  # a signal arrived
        assert await service.run(stop) == EXIT_OK
        root = service.trainer.checkpoint_dir
        assert latest_checkpoint(root) == checkpoint_path(root, 1)
    finally:
        await service.close(EXIT_OK)


async def test_a_background_failure_turns_health_not_serving_and_exits_1_without_a_checkpoint(tiny_model_dir, tmp_path):
    run = make_cfg(tiny_model_dir, tmp_path, dcp_save_interval=0)
    config = TrainerServiceConfig(run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None)
    service = create_server(config, PolicyTrainer(run))
    try:
        await service.start()
        service.trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2), step=1)
        failed = AutoSteps(
            service.buffer,
            groups_per_step=2,
            max_steps=None,
            steps_done=lambda: 0,
            train_step=service.train_step,
            finish=service.finish,
            stop=threading.Event(),
        )
        failed.failed = RuntimeError("auto steps broke")
        service.auto_steps = failed
        assert await service.run(asyncio.Event()) == EXIT_FAILED
        async with open_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            assert await check_health(channel) == "NOT_SERVING"
        assert latest_checkpoint(service.trainer.checkpoint_dir) is None
    finally:
        await service.close(EXIT_FAILED)
