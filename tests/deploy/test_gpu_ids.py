"""The trainer and inference never share a GPU (issue 26): compose reserves each its own ids (FLEETRL_TRAINER_GPUS,
FLEETRL_INFERENCE_GPUS) and both services refuse to start, naming the two variables, when the lists overlap; the
chart does the same with trainer.gpuIds / inference.gpuIds at `helm template`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetrl.gpu_layout import check_gpu_env
from tests.deploy.conftest import COMPOSE_FILE
from tests.deploy.from_compose import load_compose
from tests.deploy.test_compose import env_example


def _gpu_services(env: dict[str, str]) -> dict[str, dict]:
    services = load_compose(COMPOSE_FILE, env)["services"]
    return {name: services[name] for name in ("inference-gpu", "trainer-gpu")}


def _device_ids(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    return device["device_ids"]


def test_compose_reserves_the_trainer_and_inference_their_own_gpus():
    services = _gpu_services(env_example())
    assert _device_ids(services["inference-gpu"]) == ["0"] and _device_ids(services["trainer-gpu"]) == ["1"]
    for service in services.values():
        check_gpu_env(service["environment"])  # the shipped example passes its own check


@pytest.mark.parametrize("service", ["trainer-gpu", "inference-gpu"])
def test_compose_services_refuse_overlapping_gpu_ids(service):
    env = env_example() | {"FLEETRL_TRAINER_GPUS": "2", "FLEETRL_INFERENCE_GPUS": "2"}
    spec = _gpu_services(env)[service]
    assert _device_ids(spec) == ["2"]
    # The container's command and environment as compose gives them: the launcher fails before loading anything.
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", *spec["command"]],
        env={"PATH": "/usr/bin:/bin", **{k: str(v) for k, v in spec["environment"].items()}},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "FLEETRL_TRAINER_GPUS and FLEETRL_INFERENCE_GPUS overlap on GPU 2" in result.stderr


def test_gpu_env_check_names_a_bad_id():
    with pytest.raises(ValueError, match="FLEETRL_INFERENCE_GPUS: 'x' is not a GPU id"):
        check_gpu_env({"FLEETRL_TRAINER_GPUS": "0", "FLEETRL_INFERENCE_GPUS": "1,x"})
    check_gpu_env({"FLEETRL_TRAINER_GPUS": "0,1", "FLEETRL_INFERENCE_GPUS": "2,3"})
