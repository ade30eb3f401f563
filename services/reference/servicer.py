"""`ReferenceServicer`: fleetrl.v1.Reference over gRPC. `ComputeLogprobs` validates the request, hands it to the
service's `LogprobBatcher` and maps failures to status codes; `Status` reports the totals."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

import grpc

from fleetrl.v1 import reference_pb2, reference_pb2_grpc

if TYPE_CHECKING:
    from fleetrl.services.reference.server import ReferenceService


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

    async def ComputeLogprobs(
        self, request: reference_pb2.ComputeLogprobsRequest, context: grpc.aio.ServicerContext
    ) -> reference_pb2.ComputeLogprobsResponse:
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

    async def Status(
        self, request: reference_pb2.ReferenceStatusRequest, context: grpc.aio.ServicerContext
    ) -> reference_pb2.ReferenceStatusResponse:
        totals = self._service.metrics.totals
        return reference_pb2.ReferenceStatusResponse(
            model=self._service.config.model,
            requests=totals["requests"],
            sequences=totals["sequences"],
            tokens=totals["tokens"],
            batches=totals["batches"],
            tokens_per_s=self._service.metrics.tokens_per_s(),
        )
