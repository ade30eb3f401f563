"""What a sampling call sends and gets back, shared by the inference service, its clients and the sampler.

Logprob semantics: each generated token carries the log-probability under the distribution it was actually sampled
from, i.e. after temperature scaling, top-k and top-p truncation and renormalisation (vLLM's "processed_logprobs").
The trainer's importance ratios divide by exactly this number. temperature 0 means greedy (argmax; top-p/top-k
ignored) and, as in vLLM, reports the untempered log_softmax of the chosen token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
MAX_STOP_STRINGS = 64  # stop strings per request at most (each is searched for after every token)


class WeightLoadError(RuntimeError):
    """A weight load was rejected (transfer failed, checksum, unknown name, wrong shape/dtype, ...).

    The engine keeps serving the version it had before the call.
    """


class EngineError(RuntimeError):
    """The engine failed to serve a request for a reason other than bad input."""


@dataclass(frozen=True)
class SamplingRequest:
    """One generate call: n completions of one prompt."""

    prompt_token_ids: list[int]
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off: the full distribution by default
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # the tokenizer's eos is always a stop token as well
    seed: int | None = None  # completion i of a seeded request uses seed + i
    ignore_eos: bool = False  # keep generating past eos (benchmarks want fixed lengths)
    seeds: tuple[int, ...] = ()  # instead of seed: one per completion, completion i uses seeds[i]
    # Stop strings: a completion ends with the token that completes the first one to appear in its decoded text
    # (special tokens skipped), finish_reason "stop"; the tokens and logprobs end there (the stop text included).
    stop: tuple[str, ...] = ()

    def sequence_seed(self, i: int) -> int | None:
        """The seed of completion `i` (None: unseeded)."""
        if self.seeds:
            return self.seeds[i]
        return None if self.seed is None else self.seed + i

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        """Raise ValueError naming the offending field."""
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if vocab_size is not None:
            bad = [t for t in self.prompt_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        elif any(t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be non-negative")
        if not 1 <= self.n <= 1024:
            raise ValueError(f"n must be in [1, 1024], got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if max_model_len is not None and len(self.prompt_token_ids) + self.max_tokens > max_model_len:
            raise ValueError(
                f"prompt length ({len(self.prompt_token_ids)}) + max_tokens ({self.max_tokens}) exceeds "
                f"the model's max length {max_model_len}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.seeds:
            if self.seed is not None:
                raise ValueError("set seed or seeds, not both")
            if len(self.seeds) != self.n:
                raise ValueError(f"seeds must hold one seed per completion (n = {self.n}), got {len(self.seeds)}")
            if not all(0 <= s < 2**63 for s in self.seeds):
                raise ValueError(f"every seed must be in [0, 2**63), got {list(self.seeds)[:5]}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(self.stop)[:5]!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")


@dataclass
class Completion:
    """One generated continuation of the prompt."""

    token_ids: list[int]  # generated tokens only (a stop token that ended it is included)
    logprobs: list[float]  # one per generated token, under the distribution actually sampled from
    finish_reason: str  # "stop" | "length"
    prompt_len: int
    versions: list[int] = field(default_factory=list)  # policy version that produced each token


@dataclass(frozen=True)
class LoadResult:
    """What a successful weight load did."""

    version: int
    checksum: str
    transfer_s: float  # fetching + verifying the bytes (generation kept running)
    pause_s: float  # time generation was stopped for the swap
    transport: str = "zmq"  # how the bytes came: "zmq" (the weight stream) or "collective" (fleetrl.weights.collective)
