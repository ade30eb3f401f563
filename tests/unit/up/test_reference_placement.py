"""Where `fleetrl up` places the KL reference (issue 26 item 5): by default a frozen copy in the trainer's ranks
(`--reference local`, no process); with reference_placement = "service" a reference service on the trainer's
device and compute dtype, on GPUs of its own. The command lines are recorded; no process starts."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fleetrl.config import Config, ConfigError
from fleetrl.up import run as up_run
from fleetrl.up.config import UpConfig
from fleetrl.up.console import Startup
from fleetrl.up.supervisor import Supervisor


def up_config(tmp_path: Path, **up: object) -> UpConfig:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {"base_model": "m"}, "up": {"rollout": "m:f", **up}}))
    return UpConfig.from_file(path)


def started_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: Config, up: UpConfig) -> dict[str, dict]:
    """`_start_stack`'s children: name -> {argv, env}, every service 'ready' at once on a made-up port."""
    started: dict[str, dict] = {}

    class FakePopen:  # records the command line; no process is started
        def __init__(self, argv, **kwargs):
            self.argv, self.pid = argv, 0

    monkeypatch.setattr("fleetrl.up.supervisor.subprocess.Popen", FakePopen)
    sup = Supervisor(tmp_path / "logs")
    monkeypatch.setattr(sup, "wait_ready", lambda child, *a, **k: {"grpc_port": 7000 + len(sup.children)})
    threads = up_run._thread_plan(run, up)
    with Startup(up_run.stack_size(run, up), stream=io.StringIO()) as startup:
        up_run._start_stack(sup, ["--config", "run.toml"], run, up, False, [], threads, startup)
    for child in sup.children:
        started[child.name] = {"argv": child.argv, "env": child.env}
    return started


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture(autouse=True)
def _sixteen_cpus(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(up_run, "available_cpus", lambda: 16)


def test_by_default_the_reference_is_a_frozen_copy_in_the_trainer_and_no_process(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.01)
    up = up_config(tmp_path)
    assert up.reference_placement == "trainer"
    services = started_stack(tmp_path, monkeypatch, run, up)
    assert set(services) == {"inference-0", "trainer", "controller"}
    assert flag(services["trainer"]["argv"], "--reference") == "local"
    assert up_run.stack_size(run, up) == 3  # replica, trainer, controller: nothing waits for a reference
    # The colocated forward runs on the trainer's threads: an on-policy run (O = 0, the default) takes turns
    # training and sampling, so the trainer gets every core; the replica keeps its half.
    assert services["trainer"]["env"]["OMP_NUM_THREADS"] == "16"
    assert services["inference-0"]["env"]["OMP_NUM_THREADS"] == "8"
    off_policy = Config(base_model="m", kl_beta=0.01, max_head_offpolicy_versions=1)
    plan = up_run._thread_plan(off_policy, up)
    assert (plan.trainer, plan.inference) == (8, 8)  # the replica is the only sharer of the other half


def test_a_reference_service_runs_on_the_trainers_cpu_in_its_dtype(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.01)
    up = up_config(tmp_path, reference_placement="service")
    services = started_stack(tmp_path, monkeypatch, run, up)
    assert set(services) == {"inference-0", "reference", "trainer", "controller"}
    ref = services["reference"]["argv"]
    assert (flag(ref, "--device"), flag(ref, "--dtype")) == ("cpu", "float32")
    assert flag(services["trainer"]["argv"], "--reference") == "127.0.0.1:7002"  # the reference's ready port
    assert up_run.stack_size(run, up) == 4
    # A reference service scores groups while rollouts run: it shares the other half of the cores with the
    # replica, and the trainer keeps half even on-policy.
    assert services["reference"]["env"]["OMP_NUM_THREADS"] == services["inference-0"]["env"]["OMP_NUM_THREADS"] == "4"
    assert services["trainer"]["env"]["OMP_NUM_THREADS"] == "8"
    assert "CUDA_VISIBLE_DEVICES" not in services["reference"]["env"]


def test_a_reference_service_next_to_a_gpu_trainer_gets_its_own_gpu_and_the_bf16_compute_dtype(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.01)
    up = up_config(tmp_path, reference_placement="service", reference_gpus=[2], trainer_gpus=[1], inference_gpus=[[0]])
    services = started_stack(tmp_path, monkeypatch, run, up)
    ref = services["reference"]
    assert (flag(ref["argv"], "--device"), flag(ref["argv"], "--dtype")) == ("cuda", "bfloat16")
    assert ref["env"]["CUDA_VISIBLE_DEVICES"] == "2"
    assert services["trainer"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize(
    ("run", "up", "dtype"),
    [
        ({}, {"trainer_gpus": [0], "reference_gpus": [1]}, "bfloat16"),  # auto on CUDA: mixed precision
        ({"compute_dtype": "float32"}, {"trainer_gpus": [0], "reference_gpus": [1]}, "float32"),
        ({"dtype": "bfloat16"}, {}, "bfloat16"),  # auto on CPU: the weight dtype
        ({"compute_dtype": "bfloat16"}, {}, "bfloat16"),  # asked for on CPU too
        ({}, {"trainer_args": ["--device", "cuda"], "reference_gpus": [3]}, "bfloat16"),
    ],
)
def test_the_reference_service_dtype_is_the_trainers_compute_dtype(tmp_path, run, up, dtype):
    config = Config(base_model="m", kl_beta=0.01, **run)
    assert up_run.reference_dtype(config, up_config(tmp_path, reference_placement="service", **up)) == dtype


@pytest.mark.parametrize("placement", ["trainer", "service"])
@pytest.mark.parametrize("run", [{"kl_beta": 0.0}, {"kl_beta": 0.01, "lora_rank": 8}])
def test_no_reference_at_all_without_kl_or_with_lora(tmp_path, monkeypatch, placement, run):
    config = Config(base_model="m", **run)
    up = up_config(tmp_path, reference_placement=placement)
    services = started_stack(tmp_path, monkeypatch, config, up)
    assert set(services) == {"inference-0", "trainer", "controller"}
    assert "--reference" not in services["trainer"]["argv"]
    assert up_run.stack_size(config, up) == 3  # a LoRA run waits for no reference either


@pytest.mark.parametrize(
    ("up", "message"),
    [
        ({"reference_gpus": [2]}, "reference_gpus: the reference runs in the trainer's ranks"),
        (
            {"reference_placement": "service", "reference_gpus": [2, 3], "trainer_gpus": [0]},
            "reference_gpus has 2 GPUs: the reference service runs on one GPU",
        ),
        (
            {"reference_placement": "service", "reference_gpus": [1], "trainer_gpus": [1]},
            "reference_gpus and trainer_gpus overlap on GPU 1",
        ),
        (
            {"reference_placement": "service", "reference_gpus": [1], "inference_gpus": [[0, 1]], "trainer_gpus": [2]},
            "reference_gpus and inference_gpus overlap on GPU 1",
        ),
        (
            {"reference_placement": "service", "trainer_gpus": [0]},
            "reference_gpus: reference_placement = 'service' with the trainer on CUDA needs a GPU",
        ),
        (
            {"reference_placement": "service", "trainer_args": ["--device=cuda"]},
            "reference_gpus: reference_placement = 'service' with the trainer on CUDA needs a GPU",
        ),
        ({"reference_placement": "gpu"}, "up.reference_placement: Input should be 'trainer' or 'service'"),
    ],
)
def test_a_reference_layout_that_cannot_run_fails_naming_the_field(tmp_path, up, message):
    with pytest.raises(ConfigError, match=message):
        up_config(tmp_path, **up)
