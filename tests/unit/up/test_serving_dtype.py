"""GPU replicas serve bfloat16 unless the run says otherwise: `fleetrl up` passed the trainer's float32 to every
replica (`--dtype float32`), so a GPU run served float32 and pushed twice the bytes."""

from __future__ import annotations

import pytest

from fleetrl.config import Config
from fleetrl.up import run as up_run
from tests.unit.up.test_reference_placement import started_stack, up_config


@pytest.mark.parametrize(
    ("run", "up", "expected"),
    [
        ({}, {"inference_gpus": [[1]], "trainer_gpus": [0]}, "bfloat16"),  # GPU replicas, dtype left unset
        ({"inference_dtype": "float32"}, {"inference_gpus": [[1]], "trainer_gpus": [0]}, None),  # asked for
        ({}, {}, None),  # CPU replicas keep the trainer's dtype (exact logprobs)
    ],
)
def test_gpu_serving_dtype(tmp_path, run, up, expected):
    config = Config(base_model="m", kl_beta=0.0, **run)
    assert up_run.gpu_serving_dtype(config, up_config(tmp_path, **up)) == expected


def test_replicas_and_trainer_get_bfloat16_on_gpus(tmp_path, monkeypatch):
    config = Config(base_model="m", kl_beta=0.0)
    services = started_stack(tmp_path, monkeypatch, config, up_config(tmp_path, inference_gpus=[[1]], trainer_gpus=[0]))
    replica = services["inference-0"]["argv"]
    assert replica[replica.index("--dtype") + 1] == "bfloat16"
    trainer = services["trainer"]["argv"]
    assert "inference_dtype=bfloat16" in trainer  # the trainer publishes in the dtype the replicas serve
