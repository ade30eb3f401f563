"""The reference service: a frozen copy of the base policy behind gRPC `ComputeLogprobs`, with request
batching, the standard health service and Prometheus /metrics.

    service = create_server(config)   # loads the model, binds the gRPC port, starts nothing
    await service.start()
    ...
    await service.stop()

`serve(config)` runs it until SIGINT/SIGTERM (the launcher calls it). Logprobs come from
`fleetrl.trainer.model.sequence_logprobs`, the policy trainer's own forward, so on the base weights the two
agree. The model never steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry

from fleetrl.ready_file import write_ready_file
from fleetrl.rpc import create_grpc_server
from fleetrl.services.reference.config import ReferenceConfig
from fleetrl.services.reference.metrics import ReferenceMetrics
from fleetrl.telemetry import MetricsServer, start_metrics_server
from fleetrl.v1 import reference_pb2, reference_pb2_grpc

logger = logging.getLogger(__name__)

ComputeFn = Callable[[list[list[int]], float], list[list[float]]]


@dataclass
class _Request:
    sequences: list[list[int]]
    temperature: float
    future: asyncio.Future[list[list[float]]]
    enqueued: float = field(default_factory=time.monotonic)


class LogprobBatcher:
    """Coalesces concurrent requests (same temperature) into padded forwards of at most
    `max_batch_tokens` padded tokens; the forward runs in a worker thread, off the event loop."""

    def __init__(
        self, compute: ComputeFn, *, max_batch_tokens: int, batch_wait_s: float, metrics: ReferenceMetrics | None
    ) -> None:
        self._compute = compute
        self._max_tokens = max_batch_tokens
        self._wait_s = batch_wait_s
        self._metrics = metrics
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._carry: deque[_Request] = deque()
        self._task: asyncio.Task[None] | None = None

    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._carry)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reference-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for req in [*self._carry, *_drain(self._queue)]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("reference service is shutting down"))

    async def submit(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        if self._task is None or self._task.done():
            raise RuntimeError("reference batcher is not running")
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(sequences, temperature, future))
        return await future

    async def _next(self, timeout: float | None) -> _Request | None:
        if self._carry:
            return self._carry.popleft()
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next(None)
            assert first is not None
            batch = [first]
            tokens = sum(len(s) for s in first.sequences)
            deadline = loop.time() + self._wait_s
            while tokens < self._max_tokens:
                nxt = await self._next(max(0.0, deadline - loop.time()))
                if nxt is None:
                    break
                if nxt.temperature != first.temperature:
                    self._carry.append(nxt)
                    break
                batch.append(nxt)
                tokens += sum(len(s) for s in nxt.sequences)
            await self._serve(batch)

    async def _serve(self, batch: list[_Request]) -> None:
        sequences = [s for req in batch for s in req.sequences]
        try:
            results = await self._forward_all(sequences, batch[0].temperature)
        except Exception as exc:  # the callers get the error; the batcher keeps serving
            logger.exception("reference forward failed")
            for req in batch:
                if not req.future.done():
                    req.future.set_exception(exc)
            return
        start = 0
        for req in batch:
            n = len(req.sequences)
            if not req.future.done():
                req.future.set_result(results[start : start + n])
            start += n

    async def _forward_all(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """Forwards of at most max_batch_tokens padded tokens, longest first (less padding)."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        results: list[list[float]] = [[] for _ in sequences]
        i = 0
        while i < len(order):
            width = len(sequences[order[i]])
            j = i + 1
            while j < len(order) and (j - i + 1) * width <= self._max_tokens:
                j += 1
            chunk = [sequences[k] for k in order[i:j]]
            started = time.perf_counter()
            out = await asyncio.to_thread(self._compute, chunk, temperature)
            if self._metrics is not None:
                self._metrics.observe_forward(len(chunk), sum(len(s) for s in chunk), time.perf_counter() - started)
            for k, lp in zip(order[i:j], out, strict=True):
                results[k] = lp
            i = j
        return results


def _drain(queue: asyncio.Queue[_Request]) -> list[_Request]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def validate_request(
    request: reference_pb2.ComputeLogprobsRequest, vocab_size: int, max_len: int | None = None
) -> tuple[list[list[int]], float]:
    """The request's sequences and temperature; ValueError naming what is wrong (max_len: the model's length)."""
    temperature = request.temperature if request.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    sequences = [list(s.tokens) for s in request.sequences]
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequences[{i}] has {len(seq)} tokens; at least 2 are needed")
        if max_len is not None and len(seq) > max_len:
            raise ValueError(f"sequences[{i}] has {len(seq)} tokens, more than the model's {max_len}")
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequences[{i}] has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return sequences, temperature


class ReferenceServicer(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, service: ReferenceService) -> None:
        self._service = service

    async def ComputeLogprobs(self, request, context):
        service = self._service
        try:
            max_len = getattr(service.model.config, "max_position_embeddings", None)
            sequences, temperature = validate_request(request, service.vocab_size, max_len)
        except ValueError as exc:
            service.metrics.observe_request("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ComputeLogprobs: {exc}")
        try:
            results = await asyncio.wait_for(
                service.batcher.submit(sequences, temperature), service.config.request_timeout_s
            )
        except TimeoutError:
            service.metrics.observe_request("error")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"ComputeLogprobs: no result within {service.config.request_timeout_s}s",
            )
        except Exception as exc:  # a failed forward: report it to the caller, keep serving
            service.metrics.observe_request("error")
            await context.abort(grpc.StatusCode.INTERNAL, f"ComputeLogprobs: forward failed: {exc!r}")
        service.metrics.observe_request("ok")
        return reference_pb2.ComputeLogprobsResponse(
            sequences=[reference_pb2.SequenceLogprobs(logprobs=lp) for lp in results]
        )

    async def Status(self, request, context):
        totals = self._service.metrics.totals
        return reference_pb2.ReferenceStatusResponse(
            model=self._service.config.model,
            requests=totals["requests"],
            sequences=totals["sequences"],
            tokens=totals["tokens"],
            batches=totals["batches"],
            tokens_per_s=self._service.metrics.tokens_per_s(),
        )


@dataclass
class ReferenceService:
    """A created reference service; `start()` it, `stop()` it."""

    config: ReferenceConfig
    model: torch.nn.Module
    vocab_size: int
    registry: CollectorRegistry
    metrics: ReferenceMetrics
    batcher: LogprobBatcher
    grpc_server: grpc.aio.Server | None = None
    grpc_port: int = 0
    metrics_server: MetricsServer | None = None

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.port

    async def start(self) -> None:
        self.batcher.start()
        assert self.grpc_server is not None
        await self.grpc_server.start()
        if self.config.metrics_port is not None:
            self.metrics_server = start_metrics_server(
                self.config.metrics_port, host=self.config.host, registry=self.registry
            )
        if self.config.ready_file:
            write_ready_file(
                self.config.ready_file,
                {"grpc_port": self.grpc_port, "metrics_port": self.metrics_port, "host": self.config.host},
            )

    async def stop(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.config.shutdown_grace_s)
        await self.batcher.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()


def create_server(config: ReferenceConfig) -> ReferenceService:
    """Load the frozen model and bind the gRPC port (nothing is started)."""
    from fleetrl.trainer.model import load_causal_lm, pad_token_id, sequence_logprobs

    model = load_causal_lm(config.model, dtype=config.dtype, device=config.device, trainable=False)
    pad_id = pad_token_id(model)
    device = next(model.parameters()).device

    def compute(sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return sequence_logprobs(model, sequences, temperature=temperature, pad_id=pad_id, device=device)

    registry = CollectorRegistry()
    batcher_holder: list[LogprobBatcher] = []
    metrics = ReferenceMetrics(registry, lambda: batcher_holder[0].queue_depth() if batcher_holder else 0)
    batcher = LogprobBatcher(
        compute, max_batch_tokens=config.max_batch_tokens, batch_wait_s=config.batch_wait_ms / 1000, metrics=metrics
    )
    batcher_holder.append(batcher)
    service = ReferenceService(config, model, int(model.config.vocab_size), registry, metrics, batcher)
    servicer = ReferenceServicer(service)
    service.grpc_server, service.grpc_port = create_grpc_server(
        [lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(servicer, s)],
        host=config.host,
        port=config.grpc_port,
        auth_token=config.auth_token,
        max_message_mb=config.max_message_mb,
    )
    return service


async def serve(config: ReferenceConfig) -> None:
    """Run the reference service until SIGINT/SIGTERM."""
    service = create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
        logger.info(
            "reference service up: model %s, grpc %s:%d, metrics %s",
            config.model,
            config.host,
            service.grpc_port,
            service.metrics_port,
        )
        await stop.wait()
        logger.info("shutting down")
    finally:
        await service.stop()
