"""Conversions between the inference protos (fleetrl.v1) and the engine dataclasses, both directions.

Used by the server (request_from_proto, completions_to_proto) and by clients (request_to_proto,
completions_from_proto). Proto3 zero defaults map to the engine defaults: n 0 -> 1, max_tokens 0 -> 64,
unset temperature/top_p -> 1.0, unset seed -> None, no stop strings -> ().
"""

from __future__ import annotations

from fleetrl.clients.inference_types import Completion, SamplingRequest
from fleetrl.v1 import inference_pb2


def request_to_proto(request: SamplingRequest, request_id: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=request.prompt_token_ids,
        n=request.n,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop_token_ids=list(request.stop_token_ids),
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        request_id=request_id,
        seeds=list(request.seeds),
        stop=list(request.stop),
    )


def request_from_proto(msg: inference_pb2.GenerateRequest) -> SamplingRequest:
    """A GenerateRequest as an engine SamplingRequest (proto defaults: n 0 -> 1, max_tokens 0 -> 64)."""
    return SamplingRequest(
        prompt_token_ids=list(msg.prompt_token_ids),
        n=msg.n or 1,
        max_tokens=msg.max_tokens or 64,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        stop_token_ids=tuple(msg.stop_token_ids),
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        seeds=tuple(msg.seeds),
        stop=tuple(msg.stop),
    )


def completions_to_proto(completions: list[Completion]) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse(
        completions=[
            inference_pb2.Completion(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                prompt_len=c.prompt_len,
                versions=c.versions,
            )
            for c in completions
        ]
    )


def completions_from_proto(msg: inference_pb2.GenerateResponse) -> list[Completion]:
    """The client side of `completions_to_proto`."""
    return [
        Completion(
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            finish_reason=c.finish_reason,
            prompt_len=c.prompt_len,
            versions=list(c.versions),
        )
        for c in msg.completions
    ]
