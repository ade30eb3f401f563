"""Which OpenAI app an engine gets (services/inference/http_server.py): vLLM's own serving layer, except for a LoRA
run's vLLM replicas, whose adapter versions vLLM's layer does not know (it would answer on the base weights)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from fleetrl.services.inference import http_server
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.metrics import InferenceMetrics
from tests.unit.inference.fakes import ScriptedEngine


class VllmLike(ScriptedEngine):
    engine_name = "vllm"


def chosen(monkeypatch, tiny_model_dir: str, **config: object) -> str:
    import fleetrl.services.inference.vllm_openai as vllm_openai

    async def vllm_app(config, engine):
        return "vllm-app"

    monkeypatch.setattr(vllm_openai, "build_vllm_openai_app", vllm_app)
    engine = VllmLike()
    settings = InferenceConfig(model=tiny_model_dir, engine="vllm", **config)
    app = asyncio.run(http_server.build_app(settings, engine, InferenceMetrics(CollectorRegistry(), engine)))
    return "vllm" if app.app == "vllm-app" else "minimal"


def test_full_fine_tuning_gets_vllms_layer(monkeypatch, tiny_model_dir):
    assert chosen(monkeypatch, tiny_model_dir) == "vllm"


@pytest.mark.parametrize("rank", [8, 16])
def test_a_lora_replica_gets_the_minimal_app_which_samples_through_the_engine(monkeypatch, tiny_model_dir, rank):
    assert chosen(monkeypatch, tiny_model_dir, max_lora_rank=rank) == "minimal"
