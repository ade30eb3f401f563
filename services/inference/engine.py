"""The inference engine interface shared by the hf and vLLM engines (pure Python: no grpc, no zmq).

The gRPC server, the OpenAI HTTP API and the benchmarks talk to an `InferenceEngine`; `HFEngine`
(services/inference/hf_engine.py) and `VLLMEngine` (services/inference/vllm_engine.py) implement it with the same
semantics, checked by one conformance suite (tests/integration/inference/conformance.py).

Logprob semantics: each generated token carries the log-probability under the distribution it was actually sampled
from, i.e. after temperature scaling, top-k and top-p truncation and renormalisation (vLLM's "processed_logprobs").
The trainer's importance ratios divide by exactly this number. temperature 0 means greedy (argmax; top-p/top-k
ignored) and, as in vLLM, reports the untempered log_softmax of the chosen token: a point mass has no useful
logprob, and greedy samples are not for training anyway.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from fleetrl.clients.inference_types import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    EngineError,
    LoadResult,
    SamplingRequest,
    WeightLoadError,
)

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Completion",
    "EngineError",
    "EngineStats",
    "InferenceEngine",
    "LoadResult",
    "SamplingRequest",
    "WeightLoadError",
    "check_state_dict_matches",
]


@dataclass(frozen=True)
class EngineStats:
    """Counters an engine keeps for Status and metrics."""

    generated_tokens: int  # total since start
    requests: int  # total generate calls since start
    tokens_per_s: float  # recent generation throughput


class InferenceEngine(ABC):
    """An engine that samples completions and swaps weights in place."""

    engine_name: str  # "hf" | "vllm"
    model_path: str
    loaded_version: int = 0  # 0 for the weights loaded from model_path
    loaded_checksum: str = ""
    workers: int = 1  # processes receiving weights in an engine group (vLLM: its tensor-parallel ranks)

    @abstractmethod
    async def start(self) -> None:
        """Load the model; must be called (and awaited) before anything else."""

    @abstractmethod
    async def generate(self, request: SamplingRequest) -> list[Completion]:
        """Return `request.n` completions. Raises ValueError for bad requests."""

    @abstractmethod
    async def load_weights(
        self,
        version: int,
        source: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 300.0,
        group_replicas: int = 0,
    ) -> LoadResult:
        """Fetch `version` from the weight stream at `source` while generation continues, then swap under a
        short pause. Incomplete / mismatched (unknown name, wrong shape or dtype) / bad checksum -> raise
        WeightLoadError and keep serving the previous version. `timeout_s` bounds each wait for the stream and is
        the floor of the whole load's bound, which adds the version's bytes at a conservative rate
        (fleetrl.weights.timeouts). `group_replicas` > 0: receive it by broadcast in the trainer's group for the
        version (``weight_transport = "collective"``, that many replicas pushed to), over the stream if this
        replica cannot join or the broadcast fails (`LoadResult.transport` says which)."""

    @abstractmethod
    def queue_depth(self) -> int:
        """Sequences waiting or running."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop background work and free the model."""

    def stats(self) -> EngineStats:
        """Counters for Status / metrics; engines override with real numbers."""
        return EngineStats(generated_tokens=0, requests=0, tokens_per_s=0.0)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size once started (for request validation)."""
        return None

    @property
    def max_model_len(self) -> int | None:
        """Prompt + completion length limit once started (None = unknown)."""
        return None


def check_state_dict_matches(
    expected: dict[str, tuple[tuple[int, ...], str]],
    received: dict[str, object],
    *,
    optional: frozenset[str] = frozenset(),
) -> None:
    """Check a received state dict against the live model's (name -> (shape, dtype name)).

    Raises WeightLoadError naming the unknown names, missing names (an incomplete transfer; names in
    `optional`, e.g. tied aliases, may be missing) and shape/dtype mismatches. `received` values need
    `.shape` and `.dtype` (torch tensors).
    """
    unknown = sorted(set(received) - set(expected))
    missing = sorted(set(expected) - set(received) - optional)
    problems = []
    if unknown:
        problems.append(f"unknown tensor names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if missing:
        problems.append(f"missing tensors (incomplete) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, tensor in received.items():
        if name not in expected:
            continue
        shape, dtype = expected[name]
        got_shape = tuple(tensor.shape)  # type: ignore[attr-defined]
        got_dtype = str(tensor.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        if got_shape != tuple(shape):
            problems.append(f"{name}: shape {list(got_shape)} != model's {list(shape)}")
        if got_dtype != dtype:
            problems.append(f"{name}: dtype {got_dtype} != model's {dtype}")
    if problems:
        raise WeightLoadError("weights do not match the model: " + "; ".join(problems[:10]))
