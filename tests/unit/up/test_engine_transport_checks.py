"""`run.weight_transport = "engine"` (fleetrl.weights.engine_push) is started only where it is built: vLLM replicas,
trainer and replicas both on CPU (fleetrl_gloo) or both on CUDA (vLLM's nccl), full fine-tuning, direct fan-out (any
trainer world size, tensor-parallel replicas). Anything else is refused by `fleetrl up` with exit 2 and one line naming
the field, before any service starts."""

from __future__ import annotations

import pytest

from fleetrl.up import run as up_run
from tests.unit.up.test_start_checks import refused, set_fields, starts
from tests.unit.up.test_up_config_checks import write_config

ENGINE = {"weight_transport": "engine"}


@pytest.mark.parametrize(
    ("run", "up", "message"),
    [
        ({}, {"engine": "hf"}, "run.weight_transport: 'engine' drives vLLM's weight-transfer engines"),
        ({}, {"engine": "vllm", "inference_gpus": [[0]]}, "up.trainer_gpus: weight_transport 'engine' with the"),
        ({}, {"engine": "vllm", "trainer_gpus": [0]}, "up.inference_gpus: weight_transport 'engine' with the"),
    ],
    ids=["hf-replicas", "gpu-replicas-cpu-trainer", "gpu-trainer-cpu-replicas"],
)
def test_an_engine_transport_layout_not_built_is_refused_naming_the_field(
    tmp_path, capsys, monkeypatch, run, up, message
):
    config = set_fields(write_config(tmp_path), {**ENGINE, **run}, up)
    refused(config, capsys, monkeypatch, message)


@pytest.mark.parametrize(
    ("run", "field"),
    [({"lora_rank": 8}, "lora_rank"), ({"weight_fanout": "chain"}, "weight_fanout")],
    ids=["lora", "relayed"],
)
def test_an_engine_transport_with_lora_or_relays_is_refused_naming_the_field(tmp_path, capsys, monkeypatch, run, field):
    config = set_fields(write_config(tmp_path), {**ENGINE, **run}, {"engine": "vllm"})
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "weight_transport 'engine' needs" in err and field in err, err


@pytest.mark.parametrize(
    "up",
    [{"replicas": 2}, {"trainer_procs": 2}, {"inference_tensor_parallel_size": 2}],
    ids=["two-replicas", "two-trainer-ranks", "tensor-parallel"],
)
def test_an_engine_transport_with_vllm_replicas_on_cpu_starts(tmp_path, capsys, monkeypatch, up):
    starts(set_fields(write_config(tmp_path), ENGINE, {"engine": "vllm", **up}), capsys, monkeypatch)


@pytest.mark.parametrize(
    "up",
    [
        {"trainer_gpus": [0], "inference_gpus": [[1]]},
        {"trainer_gpus": [0], "inference_gpus": [[1], [2]], "replicas": 2},
        {"trainer_gpus": [0, 1], "trainer_procs": 2, "inference_gpus": [[2, 3]], "inference_tensor_parallel_size": 2},
    ],
    ids=["one-replica", "two-replicas", "sharded-trainer-tp-replica"],
)
def test_an_engine_transport_with_trainer_and_vllm_replicas_on_gpus_starts(tmp_path, capsys, monkeypatch, up):
    starts(set_fields(write_config(tmp_path), ENGINE, {"engine": "vllm", **up}), capsys, monkeypatch)
