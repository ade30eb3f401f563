"""The trainer stopped by a signal checkpoints its last trained step (so `--resume` loses nothing), once, and only
after a step in flight has ended (or not at all when it does not end in time)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.server import create_server
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
