"""The rollout contract: what a user's rollout function returns and what its factory receives.

A user writes `make_rollout_fn(setup: RolloutSetup) -> async rollout_fn(sample_prompt) -> RolloutSample | None`.
Multi-turn trajectories flatten into one `RolloutSample`; turns are implicit in `loss_mask` transitions
(1 on tokens the policy generated, 0 on prompt, tool and user tokens).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


class InvalidSampleError(ValueError):
    """A `RolloutSample` that breaks the contract. The gateway drops and counts it; the run goes on."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"invalid RolloutSample.{field_name}: {message}")
        self.field_name = field_name


@dataclass
class RolloutSample:
    """One trajectory, flattened: every token the model saw or produced, in order.

    Attributes:
        tokens: prompt and completion token ids (all turns, in order).
        logprobs: per-token logprob from the sampler; 0.0 on positions the policy did not generate.
        loss_mask: 1 on assistant (policy-generated) tokens, 0 elsewhere.
        reward: scalar reward of the whole trajectory.
        finish_reason: why generation ended ("stop", "length", ...).
        text: the decoded completion, for logs.
        versions: policy version that generated each token (None when unknown).
        metrics: per-sample figures reported per step as `env/all/<name>`.
    """

    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    finish_reason: str = "stop"
    text: str = ""
    versions: list[int] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def validate(self) -> RolloutSample:
        """Check the contract; raise `InvalidSampleError` naming the field. Returns self."""
        validate_sample(self)
        return self

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


def _check_int_list(name: str, values: Any) -> None:
    if not isinstance(values, list | tuple):
        raise InvalidSampleError(name, f"must be a list, got {type(values).__name__}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidSampleError(name, f"position {i} is {v!r}, not an int")


def validate_sample(sample: RolloutSample, vocab_size: int | None = None) -> None:
    """Raise `InvalidSampleError` if `sample` breaks the rollout contract; with `vocab_size` (the model's
    embedding rows), a token id at or above it is refused too (it would fail the trainer's embedding lookup)."""
    if not isinstance(sample, RolloutSample):
        raise InvalidSampleError("<type>", f"expected RolloutSample, got {type(sample).__name__}")
    _check_int_list("tokens", sample.tokens)
    _check_int_list("loss_mask", sample.loss_mask)
    n = len(sample.tokens)
    if n < 2:
        raise InvalidSampleError("tokens", f"needs at least 2 tokens (prompt + completion), got {n}")
    if not isinstance(sample.logprobs, list | tuple):
        raise InvalidSampleError("logprobs", "must be a list of floats")
    for name, seq in (("logprobs", sample.logprobs), ("loss_mask", sample.loss_mask)):
        if len(seq) != n:
            raise InvalidSampleError(name, f"length {len(seq)} != len(tokens) {n}")
    if sample.versions is not None:
        _check_int_list("versions", sample.versions)
        if len(sample.versions) != n:
            raise InvalidSampleError("versions", f"length {len(sample.versions)} != len(tokens) {n}")
    bad_tok = next((i for i, t in enumerate(sample.tokens) if t < 0), None)
    if bad_tok is not None:
        raise InvalidSampleError("tokens", f"negative token id {sample.tokens[bad_tok]} at {bad_tok}")
    if vocab_size is not None:
        bad_tok = next((i for i, t in enumerate(sample.tokens) if t >= vocab_size), None)
        if bad_tok is not None:
            token = sample.tokens[bad_tok]
            raise InvalidSampleError(
                "tokens", f"token id {token} at {bad_tok} is >= the model's vocabulary size {vocab_size}"
            )
    bad_mask = next((i for i, m in enumerate(sample.loss_mask) if m not in (0, 1)), None)
    if bad_mask is not None:
        raise InvalidSampleError("loss_mask", f"value {sample.loss_mask[bad_mask]} at {bad_mask}; must be 0 or 1")
    # Position 0 is never a target (the one-position shift), so a mask there trains nothing.
    if not any(sample.loss_mask[1:]):
        raise InvalidSampleError("loss_mask", "no masked (trainable) token after position 0")
    if isinstance(sample.reward, bool) or not isinstance(sample.reward, int | float):
        raise InvalidSampleError("reward", f"must be a number, got {type(sample.reward).__name__}")
    if not math.isfinite(sample.reward):
        raise InvalidSampleError("reward", f"must be finite, got {sample.reward}")
    for i, (lp, m) in enumerate(zip(sample.logprobs, sample.loss_mask, strict=True)):
        if not isinstance(lp, int | float) or isinstance(lp, bool):
            raise InvalidSampleError("logprobs", f"position {i} is {lp!r}, not a float")
        if m and not (math.isfinite(lp) and lp <= 1e-6):
            raise InvalidSampleError("logprobs", f"masked position {i} has logprob {lp}")
    if not isinstance(sample.metrics, dict):
        raise InvalidSampleError("metrics", "must be a dict of name -> float")
    for key, value in sample.metrics.items():
        if not isinstance(key, str):
            raise InvalidSampleError("metrics", f"key {key!r} is not a string")
        if isinstance(value, bool):
            continue  # True/False count as 1/0, e.g. metrics={"correct": True}
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidSampleError("metrics", f"{key!r} = {value!r} is not a finite number")


@dataclass
class RolloutSetup:
    """What the rollout factory receives once per gateway.

    Attributes:
        tokenizer: the run's tokenizer (a transformers tokenizer), for chat templates and decoding.
        sampler: the inference client (filled by the gateway), with the Fireworks-cookbook interface
            `sample_with_prompt_tokens(...)` / `sample_with_tokens(messages=...)`.
        sample_kwargs: the run's sampling settings (max_tokens, temperature, top_p, top_k).
        completions_per_prompt: G, the group size.
        extras: free-form values from the config (`rollout_extras`).
        max_seq_len: the longest trajectory the trainer takes; longer samples are dropped and counted.
    """

    tokenizer: Any = None
    sampler: Any = None
    sample_kwargs: dict[str, Any] = field(default_factory=dict)
    completions_per_prompt: int = 2
    extras: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int | None = None


RolloutFn = Callable[[dict[str, Any]], Awaitable[RolloutSample | None]]
RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]
