"""The inference service (gRPC + the OpenAI app) on an already started engine, for the tests that call it
through its endpoints (test_vllm_server.py, test_vllm_openai.py, test_vllm_openai_lora.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai

from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.server import InferenceService, create_server


@asynccontextmanager
async def serve(
    engine: Any, model_dir: str, *, model: str, token: str, **config: Any
) -> AsyncIterator[InferenceService]:
    """Start the service on `engine` (every port picked; `config` adds InferenceConfig fields); stop it after."""
    settings = InferenceConfig(
        model=model_dir,
        engine="vllm",
        grpc_port=0,
        http_port=0,
        metrics_port=0,
        served_model_name=model,
        auth_token=token,
        **config,
    )
    service = create_server(settings, engine)
    await service.start(start_engine=False)
    try:
        yield service
    finally:
        await service.stop()


@asynccontextmanager
async def serve_with_client(
    engine: Any, model_dir: str, *, model: str, token: str, timeout_s: float = 120, **config: Any
) -> AsyncIterator[tuple[InferenceService, openai.AsyncOpenAI]]:
    """`serve`, plus an `openai` client of its HTTP API (no retries)."""
    async with serve(engine, model_dir, model=model, token=token, relay_port=None, **config) as service:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key=token, max_retries=0, timeout=timeout_s
        )
        try:
            yield service, client
        finally:
            await client.close()
