"""The inference server: an engine behind the gRPC API (fleetrl.v1.Inference), the OpenAI-compatible HTTP
API and a Prometheus /metrics endpoint.

    service = create_server(config, engine)   # binds the gRPC port, starts nothing
    await service.start()                     # engine, gRPC, HTTP, metrics
    ...
    await service.stop()

`serve(config)` builds the engine from the config and runs until SIGINT/SIGTERM (the launcher calls it).
The servicer is thin: it converts protos to engine dataclasses and engine errors to gRPC status codes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry

from fleetrl.clients.inference_proto import completions_to_proto, request_from_proto
from fleetrl.membership import keep_registered
from fleetrl.ready_file import write_ready_file
from fleetrl.rpc import create_grpc_server, resolve_auth_token
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import EngineError, InferenceEngine, WeightLoadError
from fleetrl.services.inference.metrics import InferenceMetrics
from fleetrl.telemetry import MetricsServer, start_metrics_server
from fleetrl.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """fleetrl.v1.Inference on top of an InferenceEngine."""

    def __init__(self, engine: InferenceEngine, metrics: InferenceMetrics, config: InferenceConfig) -> None:
        self._engine = engine
        self._metrics = metrics
        self._config = config

    async def Generate(self, request, context):
        try:
            async with self._metrics.track_request("grpc"):
                completions = await self._engine.generate(request_from_proto(request))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Generate: {exc}")
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Generate: {exc}")
        self._metrics.observe_completions(completions)
        return completions_to_proto(completions)

    async def Status(self, request, context):
        stats = self._engine.stats()
        return inference_pb2.StatusResponse(
            model=self._engine.model_path,
            engine=self._engine.engine_name,
            loaded_version=self._engine.loaded_version,
            loaded_checksum=self._engine.loaded_checksum,
            queue_depth=self._engine.queue_depth(),
            tokens_per_s=stats.tokens_per_s,
            generated_tokens=stats.generated_tokens,
            requests=stats.requests,
        )

    async def LoadWeights(self, request, context):
        timeout_s = request.timeout_s or self._config.weight_load_timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            message = f"LoadWeights: timeout_s must be a finite number > 0, got {timeout_s}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            result = await self._engine.load_weights(
                request.version,
                request.source,
                auth_token=resolve_auth_token(self._config.auth_token),
                timeout_s=timeout_s,
            )
        except WeightLoadError as exc:
            self._metrics.observe_load(None)
            logger.warning(
                "weight load of version %d from %s rejected (still serving version %d): %s",
                request.version,
                request.source,
                self._engine.loaded_version,
                exc,
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"LoadWeights: {exc}")
        except EngineError as exc:
            self._metrics.observe_load(None)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"LoadWeights: {exc}")
        self._metrics.observe_load(result)
        logger.info(
            "loaded weights version %d (checksum %s) from %s: transfer %.3f s, pause %.4f s",
            result.version,
            result.checksum,
            request.source,
            result.transfer_s,
            result.pause_s,
        )
        return inference_pb2.LoadWeightsResponse(
            version=result.version,
            checksum=result.checksum,
            transfer_s=result.transfer_s,
            pause_s=result.pause_s,
        )


@dataclass
class InferenceService:
    """A created inference server; `start()` it, `stop()` it."""

    config: InferenceConfig
    engine: InferenceEngine
    grpc_server: grpc.aio.Server
    grpc_port: int
    metrics: InferenceMetrics
    registry: CollectorRegistry
    http_port: int | None = None
    metrics_server: MetricsServer | None = None
    _http: object | None = field(default=None, repr=False)
    _engine_started: bool = False

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.port

    async def start(self, *, start_engine: bool = True) -> None:
        """Start the engine (unless already started by the caller), then every endpoint."""
        if start_engine:
            await self.engine.start()
            self._engine_started = True
        await self.grpc_server.start()
        if self.config.metrics_port is not None:
            self.metrics_server = start_metrics_server(
                self.config.metrics_port, host=self.config.host, registry=self.registry
            )
        if self.config.http_port is not None:
            from fleetrl.services.inference.http_api import start_http_server

            self._http, self.http_port = await start_http_server(self.config, self.engine, self.metrics)

    async def stop(self) -> None:
        """Stop endpoints, then the engine if this service started it."""
        if self._http is not None:
            await self._http.stop()  # type: ignore[attr-defined]
            self._http = None
        await self.grpc_server.stop(self.config.shutdown_grace_s)
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._engine_started:
            await self.engine.shutdown()
            self._engine_started = False


def create_server(config: InferenceConfig, engine: InferenceEngine) -> InferenceService:
    """Build the gRPC server (bound, not started) and metrics for `engine`."""
    registry = CollectorRegistry()
    metrics = InferenceMetrics(registry, engine)
    servicer = InferenceServicer(engine, metrics, config)
    server, port = create_grpc_server(
        [lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=config.auth_token,
        max_message_mb=config.max_message_mb,
    )
    return InferenceService(config, engine, server, port, metrics, registry)


def make_engine(config: InferenceConfig) -> InferenceEngine:
    """The engine the config asks for (vLLM imported only when chosen)."""
    if config.engine == "hf":
        from fleetrl.services.inference.hf_engine import HFEngine

        return HFEngine(
            config.model,
            max_num_seqs=config.max_num_seqs,
            dtype=config.dtype,
            seed=config.seed,
            request_timeout_s=config.request_timeout_s,
            max_lora_rank=config.max_lora_rank,
        )
    from fleetrl.services.inference.vllm_engine import VLLMEngine

    kwargs = {} if config.max_model_len is None else {"max_model_len": config.max_model_len}
    return VLLMEngine(
        config.model,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=config.dtype,
        seed=config.seed,
        kv_cache_gib=config.kv_cache_gib,
        max_lora_rank=config.max_lora_rank,
        **kwargs,
    )


async def serve(config: InferenceConfig) -> None:
    """Run the inference server until SIGINT/SIGTERM."""
    engine = make_engine(config)
    service = create_server(config, engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        logger.info(
            "inference server up: model %s, engine %s, grpc %s:%d, http %s, metrics %s",
            config.model,
            engine.engine_name,
            config.host,
            service.grpc_port,
            service.http_port,
            service.metrics_port,
        )
        if config.ready_file:
            write_ready_file(
                config.ready_file,
                {
                    "host": config.host,
                    "grpc_port": service.grpc_port,
                    "http_port": service.http_port,
                    "metrics_port": service.metrics_port,
                },
            )
        joined = None
        if config.controller_address:  # join a run by itself: the controller brings it to the run's version
            member_id = config.member_id or f"inference-{socket.gethostname()}-{os.getpid()}"
            joined = asyncio.create_task(
                keep_registered(
                    config.controller_address,
                    "inference",
                    member_id,
                    advertised_address(config.host, service.grpc_port),
                    stop=stop,
                    auth_token=config.auth_token,
                )
            )
        await stop.wait()
        logger.info("shutting down")
        if joined is not None:  # no need to finish a call in flight to the controller
            joined.cancel()
            await asyncio.gather(joined, return_exceptions=True)
    finally:
        await service.stop()


def advertised_address(host: str, port: int) -> str:
    """The gRPC address others reach this server at: a wildcard bind is reached by this machine's name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
