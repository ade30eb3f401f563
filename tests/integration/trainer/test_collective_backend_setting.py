"""The trainer service opens its weight publisher with the run's collective_backend and its own device."""

from __future__ import annotations

import pytest

from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.services.trainer.server import create_server
from fleetrl.trainer import PolicyTrainer
from tests.unit.trainer.helpers import make_cfg

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["auto", "gloo"])
async def test_the_publisher_takes_the_runs_collective_backend_and_the_trainers_device(
    tiny_model_dir, tmp_path, backend
):
    run = make_cfg(tiny_model_dir, tmp_path, weight_transport="collective", collective_backend=backend)
    config = TrainerServiceConfig(run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None)
    service = create_server(config, PolicyTrainer(run))
    try:
        assert service.publisher.collective_backend == backend
        assert service.publisher.collective_device == "cpu"
    finally:
        await service.stop()


@pytest.mark.parametrize(("offpolicy", "overlap", "kept"), [(0, True, 2), (1, True, 3), (2, True, 3), (1, False, 2)])
async def test_with_overlapped_pushes_the_publisher_keeps_three_versions(
    tiny_model_dir, tmp_path, offpolicy, overlap, kept
):
    """The version in flight, one waiting and the newest (fleetrl.controller.push_queue): with two kept, publishing the
    newest would drop the version still being pushed."""
    run = make_cfg(tiny_model_dir, tmp_path, max_head_offpolicy_versions=offpolicy, overlap_weight_push=overlap)
    config = TrainerServiceConfig(run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None)
    service = create_server(config, PolicyTrainer(run))
    try:
        assert service.publisher.keep_versions == kept
    finally:
        await service.stop()
