"""The inference service's wiring: an engine behind the gRPC API (servicer.py), the OpenAI-compatible HTTP API
(vLLM's own serving layer, vllm_openai.py, or the hf engine's http_api.py; run by http_server.py) and Prometheus
metrics (metrics.py), optionally joined to a run's controller.

`InferenceService` is a `fleetrl.shell.Service`; the shell (fleetrl/shell/service.py) serves /metrics, writes the
ready file (host, grpc_port, http_port, metrics_port, relay_address), handles SIGINT/SIGTERM and turns the outcome
into the exit code. The weight relay (weight_relay.py) re-serves the versions loaded through it to peers. The
launcher makes one call:

    code = await serve(config)     # make_engine + create_server + run_service

In process (tests, benchmarks), without the shell, the service serves its own /metrics endpoint:

    service = create_server(config, engine)   # binds the gRPC port, starts nothing
    info = await service.start()              # engine, gRPC, HTTP, metrics; returns the ready-file info
    ...
    await service.stop()
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from fleetrl.inference.membership import keep_registered
from fleetrl.rpc import create_grpc_server
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import InferenceEngine
from fleetrl.services.inference.http_server import HttpServer
from fleetrl.services.inference.metrics import InferenceMetrics
from fleetrl.services.inference.servicer import InferenceServicer
from fleetrl.services.inference.weight_relay import ReplicaRelay, pick_relay_port
from fleetrl.shell.service import EXIT_OK, Service, ShellConfig, run_service
from fleetrl.telemetry import MetricsServer, start_metrics_server
from fleetrl.v1 import inference_pb2_grpc

logger = logging.getLogger(__name__)


class InferenceService(Service):
    """A created inference server: start() brings up the engine and every endpoint, stop() releases them."""

    name = "inference"

    def __init__(
        self,
        config: InferenceConfig,
        engine: InferenceEngine,
        grpc_server: grpc.aio.Server,
        grpc_port: int,
        metrics: InferenceMetrics,
        relay: ReplicaRelay | None = None,
    ) -> None:
        self.config = config
        self.relay = relay  # relays the versions loaded through it to peers (None: relay off)
        self.engine = engine
        self.grpc_server = grpc_server
        self.grpc_port = grpc_port
        self.metrics = metrics
        self.http_port: int | None = None
        self.metrics_server: MetricsServer | None = None  # its own /metrics endpoint (in-process use only)
        self._metrics_bound = False  # the shell serves the metrics
        self._http: HttpServer | None = None
        self._engine_started = False

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    @property
    def metrics_port(self) -> int | None:
        """The port of the service's own /metrics endpoint (None under the shell, which serves it)."""
        return None if self.metrics_server is None else self.metrics_server.port

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Serve the service's collectors on the shell's /metrics endpoint."""
        registry.register(self.metrics.registry)
        self._metrics_bound = True

    async def start(self, *, start_engine: bool = True) -> dict[str, Any]:
        """Start the engine (unless the caller started it), then every endpoint; returns the ready-file info."""
        if start_engine:
            await self.engine.start()
            self._engine_started = True
        await self.grpc_server.start()
        config = self.config
        if config.metrics_port is not None and not self._metrics_bound:
            self.metrics_server = start_metrics_server(config.metrics_port, host=config.host, registry=self.registry)
        if config.http_port is not None:
            from fleetrl.services.inference.http_server import start_http_server

            self._http, self.http_port = await start_http_server(config, self.engine, self.metrics)
        logger.info(
            "inference server up: model %s, engine %s, grpc %s:%d, http %s",
            config.model,
            self.engine.engine_name,
            config.host,
            self.grpc_port,
            self.http_port,
        )
        return self.ready_info()

    def ready_info(self) -> dict[str, Any]:
        """Where the service listens: host, grpc_port, http_port, metrics_port (None = off) and relay_address (the
        weight relay's, None = off). Under the shell, the shell adds metrics_port itself."""
        info: dict[str, Any] = {"host": self.config.host, "grpc_port": self.grpc_port, "http_port": self.http_port}
        info["relay_address"] = None if self.relay is None else self.relay.address
        if not self._metrics_bound:
            info["metrics_port"] = self.metrics_port
        return info

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop`; with a controller address, stay registered with that run meanwhile."""
        joined = None
        config = self.config
        if config.controller_address:  # join a run by itself: the controller brings it to the run's version
            member_id = config.member_id or f"inference-{socket.gethostname()}-{os.getpid()}"
            joined = asyncio.create_task(
                keep_registered(
                    config.controller_address,
                    "inference",
                    member_id,
                    advertised_address(config.host, self.grpc_port, config.advertise_host),
                    stop=stop,
                    auth_token=config.auth_token,
                )
            )
        try:
            await stop.wait()
            logger.info("shutting down")
        finally:
            if joined is not None:  # no need to finish a call in flight to the controller
                joined.cancel()
                await asyncio.gather(joined, return_exceptions=True)
        return EXIT_OK

    async def close(self, code: int) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop endpoints, then the engine if this service started it."""
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await self.grpc_server.stop(self.config.shutdown_grace_s)
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.relay is not None:
            await self.relay.close()
        if self._engine_started:
            await self.engine.shutdown()
            self._engine_started = False


def create_server(config: InferenceConfig, engine: InferenceEngine) -> InferenceService:
    """Build the gRPC server (bound, not started), the weight relay (its port picked, nothing bound) and metrics
    for `engine`."""
    metrics = InferenceMetrics(CollectorRegistry(), engine)
    relay = None
    if config.relay_port is not None:
        port = config.relay_port or pick_relay_port(config.host)
        bind_host = f"[{config.host}]" if ":" in config.host else config.host
        relay = ReplicaRelay(
            f"tcp://{bind_host}:{port}",
            "tcp://" + advertised_address(config.host, port, config.advertise_host),
            timeout_s=config.relay_timeout_s,
        )
    servicer = InferenceServicer(
        engine,
        metrics,
        weight_load_timeout_s=config.weight_load_timeout_s,
        auth_token=config.auth_token,
        relay=relay,
    )
    server, port = create_grpc_server(
        [lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=config.auth_token,
        max_message_mb=config.max_message_mb,
    )
    return InferenceService(config, engine, server, port, metrics, relay)


def hf_default_device() -> str:
    """cuda when a GPU is visible to this process (fleetrl up and compose set CUDA_VISIBLE_DEVICES per replica)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(config: InferenceConfig) -> InferenceEngine:
    """The engine the config asks for (vLLM imported only when chosen)."""
    if config.engine == "hf":
        from fleetrl.services.inference.hf_engine import HFEngine

        return HFEngine(
            config.model,
            max_num_seqs=config.max_num_seqs or 64,
            dtype=config.dtype or "float32",
            seed=config.seed,
            request_timeout_s=config.request_timeout_s,
            max_lora_rank=config.max_lora_rank,
            device=config.device or hf_default_device(),
        )
    from fleetrl.services.inference.vllm_engine import VLLMEngine

    # Settings left None take the device's default when the engine starts (replica_settings.py).
    return VLLMEngine(
        config.model,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        seed=config.seed,
        max_model_len=config.max_model_len,
        kv_cache_gib=config.kv_cache_gib,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        request_timeout_s=config.request_timeout_s,
        max_lora_rank=config.max_lora_rank,
        kv_on_swap=config.kv_on_swap,
    )


async def serve(config: InferenceConfig) -> int:
    """Run the inference server under the service shell until SIGINT/SIGTERM; returns the exit code.
    Raises OSError when the gRPC port cannot be bound."""
    service = create_server(config, make_engine(config))
    return await run_service(service, ShellConfig.of(config))


def advertised_address(host: str, port: int, advertise_host: str | None = None) -> str:
    """The address others reach this server's `port` at: `advertise_host` when given, else the bound host (a
    wildcard bind is reached by this machine's name)."""
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
