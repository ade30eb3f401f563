"""The trainer and inference never share a GPU (issue 26): compose reserves each its own ids (FLEETRL_TRAINER_GPUS,
FLEETRL_INFERENCE_GPUS) and both services refuse to start, naming the two variables, when the lists overlap; the
chart names no GPU ids at all (the device plugin allocates `nvidia.com/gpu`, never one GPU to two containers)."""

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


def test_chart_pods_get_gpus_only_from_the_device_plugin():
    """The chart picks no GPU ids: each GPU pod asks for `nvidia.com/gpu` and the device plugin hands every container
    GPUs of its own, so inference and the trainer cannot overlap. A *_VISIBLE_DEVICES variable in a pod would
    bypass that allocation; none is set."""
    from tests.deploy.from_chart import CHART, WORKLOADS, render_chart, values_file

    manifests = render_chart(values_file(CHART / "values-gpu-scaled.yaml"), name="gpus")
    gpus_by_workload = {}
    for manifest in manifests:
        if manifest["kind"] not in WORKLOADS:
            continue
        for container in manifest["spec"]["template"]["spec"]["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            assert not {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"} & names, manifest["metadata"]["name"]
            limits = (container.get("resources") or {}).get("limits") or {}
            gpus_by_workload[manifest["metadata"]["name"]] = limits.get("nvidia.com/gpu", 0)
    assert gpus_by_workload["gpus-fleetrl-trainer"] == 8
    assert gpus_by_workload["gpus-fleetrl-inference"] == 1


def test_a_reference_service_gpu_shared_with_the_trainer_is_refused_where_the_service_runs():
    """FLEETRL_REFERENCE_GPUS counts only when the trainer uses the reference service (FLEETRL_REFERENCE names it):
    the colocated default lives on the trainer's own GPUs, whatever the variable says."""
    env = env_example() | {"FLEETRL_REFERENCE": "reference:50061", "FLEETRL_REFERENCE_GPUS": "1"}
    spec = _gpu_services(env)["trainer-gpu"]
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", *spec["command"]],
        env={"PATH": "/usr/bin:/bin", **{k: str(v) for k, v in spec["environment"].items()}},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "FLEETRL_TRAINER_GPUS and FLEETRL_REFERENCE_GPUS overlap on GPU 1" in result.stderr
    with pytest.raises(ValueError, match="FLEETRL_INFERENCE_GPUS and FLEETRL_REFERENCE_GPUS overlap on GPU 0"):
        check_gpu_env(env | {"FLEETRL_REFERENCE_GPUS": "0"})
    check_gpu_env(env | {"FLEETRL_REFERENCE": "local"})  # colocated: its GPUs are the trainer's
    check_gpu_env(env | {"FLEETRL_REFERENCE_GPUS": ""})  # a service without GPU ids (on CPU)
    for service in _gpu_services(env_example()).values():  # the shipped example: 0, 1 and 2
        check_gpu_env({**service["environment"], "FLEETRL_REFERENCE": "reference:50061"})
