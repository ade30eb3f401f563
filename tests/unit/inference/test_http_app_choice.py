"""Which OpenAI app an engine gets (services/inference/http_server.py): vLLM's own serving layer for the vLLM
engine, LoRA runs included (where each request holds the adapters it may use: `holding_adapters`); http_api.py's
minimal app for the hf engine."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from fleetrl.services.inference import http_server
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.metrics import InferenceMetrics
from tests.unit.inference.fakes import ScriptedEngine


class HfLike(ScriptedEngine):
    engine_name = "hf"


class VllmLike(ScriptedEngine):
    engine_name = "vllm"

    @contextlib.asynccontextmanager
    async def holding_adapters(self):
        yield


def built(monkeypatch, tiny_model_dir: str, engine: ScriptedEngine, **config: object):
    import fleetrl.services.inference.vllm_openai as vllm_openai

    async def vllm_app(config, engine):
        return "vllm-app"

    monkeypatch.setattr(vllm_openai, "build_vllm_openai_app", vllm_app)
    settings = InferenceConfig(model=tiny_model_dir, engine=engine.engine_name, **config)
    return asyncio.run(http_server.build_app(settings, engine, InferenceMetrics(CollectorRegistry(), engine)))


def test_full_fine_tuning_gets_vllms_layer(monkeypatch, tiny_model_dir):
    app = built(monkeypatch, tiny_model_dir, VllmLike())
    assert app.app == "vllm-app" and app.track is None


@pytest.mark.parametrize("rank", [8, 16])
def test_a_lora_replica_gets_vllms_layer_and_requests_hold_their_adapters(monkeypatch, tiny_model_dir, rank):
    engine = VllmLike()
    app = built(monkeypatch, tiny_model_dir, engine, max_lora_rank=rank)
    assert app.app == "vllm-app" and app.track == engine.holding_adapters


def test_the_hf_engine_gets_the_minimal_app(monkeypatch, tiny_model_dir):
    app = built(monkeypatch, tiny_model_dir, HfLike())
    assert app.app != "vllm-app" and app.track is None
