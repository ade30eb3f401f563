"""The uvicorn server that runs the OpenAI-compatible app as a task in the service's event loop: vLLM's own OpenAI
serving layer on the engine's AsyncLLM for engine "vllm" (vllm_openai.py, LoRA runs included), the minimal app of
http_api.py for engine "hf"; either wrapped in http_auth.py's middleware (the run's token, the policy-version headers).

    server, port = await start_http_server(config, engine, metrics)   # config.http_port 0 = pick
    ...
    await server.stop()

uvicorn does not install signal handlers here (the service shell owns SIGINT/SIGTERM) and runs no lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

from fleetrl.rpc import resolve_auth_token
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import InferenceEngine
from fleetrl.services.inference.http_auth import AuthVersionMiddleware
from fleetrl.services.inference.metrics import InferenceMetrics

_START_TIMEOUT_S = 30.0


class HttpServer:
    """A uvicorn server running an app as a task in the current event loop."""

    def __init__(self, server: Any, task: asyncio.Task) -> None:
        self._server, self._task = server, task

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)
        except TimeoutError:
            self._task.cancel()


def _request_counter(metrics: InferenceMetrics) -> Callable[[str, int], None]:
    """Counts vLLM's generate responses in fleetrl_inference_requests_total{api,outcome}."""
    from fleetrl.services.inference.vllm_openai import request_outcome

    def observe(path: str, status: int) -> None:
        counted = request_outcome(path, status)
        if counted is not None:
            metrics.requests.labels(api=counted[0], outcome=counted[1]).inc()

    return observe


async def build_app(config: InferenceConfig, engine: InferenceEngine, metrics: InferenceMetrics) -> Any:
    """The ASGI app for `engine`: vLLM's OpenAI app (its generate requests counted in `metrics` as they start;
    with LoRA, the served model name mapped to the newest adapter version, whose adapters requests keep while
    they run) or, for the hf engine, http_api.py's (which counts its own), behind the auth and version
    middleware."""
    observe: Callable[[str, int], None] | None = None
    track = None
    if engine.engine_name == "vllm":
        from fleetrl.services.inference.vllm_openai import build_vllm_openai_app

        app = await build_vllm_openai_app(config, engine)
        observe = _request_counter(metrics)
        if config.max_lora_rank:
            track = engine.holding_adapters
    else:
        from transformers import AutoTokenizer

        from fleetrl.services.inference.http_api import create_app

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, config.model)
        app = create_app(engine, tokenizer, metrics, config)
    token = resolve_auth_token(config.auth_token)
    return AuthVersionMiddleware(
        app, token=token, version_fn=lambda: engine.loaded_version, observe=observe, track=track
    )


async def start_http_server(
    config: InferenceConfig, engine: InferenceEngine, metrics: InferenceMetrics
) -> tuple[HttpServer, int]:
    """Serve the OpenAI API on config.host:config.http_port (0 = pick); returns (server, port)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def capture_signals(self):  # the service owns SIGINT/SIGTERM, not uvicorn
            return contextlib.nullcontext()

    app = await build_app(config, engine, metrics)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((config.host, config.http_port or 0))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind HTTP API to {config.host}:{config.http_port}: {exc}") from exc
    port = int(sock.getsockname()[1])
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = _Server(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-api")
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError("the HTTP API stopped during startup")
        if time.monotonic() > deadline:
            task.cancel()
            raise TimeoutError(f"the HTTP API did not start within {_START_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.01)
    return HttpServer(server, task), port
