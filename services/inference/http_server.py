"""The uvicorn server that runs the OpenAI-compatible app (http_api.py) as a task in the service's event loop.

    server, port = await start_http_server(config, engine, metrics)   # config.http_port 0 = pick
    ...
    await server.stop()

uvicorn does not install signal handlers here: the service shell owns SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import InferenceEngine
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


async def start_http_server(
    config: InferenceConfig, engine: InferenceEngine, metrics: InferenceMetrics
) -> tuple[HttpServer, int]:
    """Serve the OpenAI API on config.host:config.http_port (0 = pick); returns (server, port)."""
    import uvicorn
    from transformers import AutoTokenizer

    from fleetrl.services.inference.http_api import create_app

    class _Server(uvicorn.Server):
        def capture_signals(self):  # the service owns SIGINT/SIGTERM, not uvicorn
            return contextlib.nullcontext()

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, config.model)
    app = create_app(engine, tokenizer, metrics, config)
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
