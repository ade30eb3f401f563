"""The rollout contract: what a user's rollout function returns and what its factory receives.

A user writes `make_rollout_fn(setup: RolloutSetup) -> async rollout_fn(sample_prompt) -> result`, where the
result is one of:

- a `RolloutSample`: one trajectory, flattened; turns are implicit in `loss_mask` transitions (1 on tokens the
  policy generated, 0 on prompt, tool and user tokens);
- a `RolloutRun`: one trajectory as several segments, each with its own tokens, logprobs and mask (the current
  cookbook's shape). A segment whose tokens start with the previous segment's tokens extends it and is merged into
  one sample; a segment that does not (the observation was rewritten, e.g. a truncated history) starts a new
  sample. Every sample of a run carries the run's reward (see `RolloutRun`);
- None: drop this sample (counted).

Anything else stops the gateway (`RolloutReturnTypeError`, exit code 4): a wrong return type is a bug in the
rollout function, not a bad sample, and a run that drops every sample trains nothing.

The rollout function may declare the cookbook's context keyword arguments (`ROLLOUT_CONTEXT_ARGS`:
`rollout_fn(row, *, rollout_idx, epoch, ...)`); it receives those it declares. A function marked with
`group_rollout` is called once per row for the whole group instead (the Tinker adapter, `fleetrl.tinker`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fleetrl.seq_len import resolve_max_seq_len

if TYPE_CHECKING:
    from fleetrl.agent_session import AgentSession
    from fleetrl.config import Config
    from fleetrl.gateway.sampler import SamplerLike


SESSION_MODEL_NAME = "policy"
"""The model name agent sessions serve (what an OpenAI-SDK agent passes as `model`)."""


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
        member: the group member (trajectory) the sample came from, set by the gateway: the samples of a
            RolloutRun split into several share one member and one advantage (None: a member of its own).
        raw_logprobs: the current cookbook's raw model logprobs aligned with `tokens`, for observability: checked
            (one per token) and, as in the cookbook, never used in place of `logprobs` in the loss or TIS.
        routing_matrices: the cookbook's MoE routes for router replay; only None or empty (fleetrl cannot replay
            expert routes in the trainer), anything else raises ValueError naming the field.
        prompt_model_input: the cookbook's `tinker.ModelInput` of the prompt; fleetrl trains on token ids only, so
            it must be text whose tokens are those of `tokens` before the first trained one (an image chunk, or
            other tokens, make the sample invalid, naming the field).
        turn_rewards: optional rewards per turn, beside the total `reward` (which the one-reward estimators use):
            one finite number per turn, turn k being the k-th run of trainable tokens (loss_mask 1 from position
            1 on), or the k-th token span of `turn_ends` when given. Turn-level estimators (`turn_discounted`, a
            user's estimator taking `turn_rewards`) credit each turn's tokens from these; without them a sample
            counts as its turns with 0 reward each but the last, which has `reward` (docs/losses.md).
        turn_ends: optional token spans for `turn_rewards`: span k is tokens[turn_ends[k-1]:turn_ends[k]] (from 0
            for k = 0), strictly increasing, the last equal to len(tokens); each span needs a trainable token.
            None: the spans are the runs of trainable tokens.
    """

    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    finish_reason: str = "stop"
    text: str = ""
    versions: list[int] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    member: int | None = None
    raw_logprobs: list[float] | None = None
    routing_matrices: list[Any] | None = None
    prompt_model_input: Any = None
    turn_rewards: list[float] | None = None
    turn_ends: list[int] | None = None

    def __post_init__(self) -> None:
        if self.routing_matrices is not None and len(self.routing_matrices) > 0:
            raise ValueError(
                "RolloutSample.routing_matrices: MoE router replay is not supported (fleetrl's trainer cannot replay "
                "the serving expert routes); leave routing_matrices None"
            )

    def validate(self) -> RolloutSample:
        """Check the contract; raise `InvalidSampleError` naming the field. Returns self."""
        validate_sample(self)
        return self

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


def trainable_runs(loss_mask: list[int]) -> list[tuple[int, int]]:
    """The runs of trainable tokens, [start, end) each, from position 1 on (position 0 is never a target)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i in range(1, len(loss_mask) + 1):
        on = i < len(loss_mask) and bool(loss_mask[i])
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append((start, i))
            start = None
    return runs


def turn_spans(sample: RolloutSample) -> list[tuple[int, int]]:
    """The sample's turns as token spans [start, end): from `turn_ends` when given, else its trainable runs. Turn
    k's tokens are the trainable ones in its span (the sample is assumed valid: `validate_sample`)."""
    if sample.turn_ends is None:
        return trainable_runs(sample.loss_mask)
    starts = [0, *sample.turn_ends[:-1]]
    return list(zip(starts, sample.turn_ends, strict=True))


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
    member = sample.member
    if member is not None and (isinstance(member, bool) or not isinstance(member, int) or member < 0):
        raise InvalidSampleError("member", f"must be a group member index (an int >= 0) or None, got {member!r}")
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
    _check_cookbook_fields(sample, n)
    _check_turns(sample, n)
    if not isinstance(sample.metrics, dict):
        raise InvalidSampleError("metrics", "must be a dict of name -> float")
    for key, value in sample.metrics.items():
        if not isinstance(key, str):
            raise InvalidSampleError("metrics", f"key {key!r} is not a string")
        if isinstance(value, bool):
            continue  # True/False count as 1/0, e.g. metrics={"correct": True}
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidSampleError("metrics", f"{key!r} = {value!r} is not a finite number")


def _check_turns(sample: RolloutSample, n: int) -> None:
    """`turn_rewards`: one finite number per turn; `turn_ends`: increasing span ends, the last len(tokens), each
    span holding a trainable token (an advantage per span lands on trainable tokens only)."""
    rewards, ends = sample.turn_rewards, sample.turn_ends
    if rewards is None:
        if ends is not None:
            raise InvalidSampleError("turn_ends", "given without turn_rewards (the spans they would reward)")
        return
    if not isinstance(rewards, list | tuple) or not rewards:
        raise InvalidSampleError("turn_rewards", "must be a non-empty list of numbers (one per turn), or None")
    for k, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
            raise InvalidSampleError("turn_rewards", f"turn {k} has {r!r}, not a finite number")
    if ends is None:
        runs = len(trainable_runs(sample.loss_mask))
        if len(rewards) != runs:
            raise InvalidSampleError(
                "turn_rewards",
                f"{len(rewards)} rewards for {runs} turns (runs of trainable tokens); give one per turn, or "
                "turn_ends for other spans",
            )
        return
    _check_int_list("turn_ends", ends)
    if len(ends) != len(rewards):
        raise InvalidSampleError("turn_ends", f"{len(ends)} span ends for {len(rewards)} turn_rewards")
    previous = 0
    for k, end in enumerate(ends):
        if end <= previous:
            raise InvalidSampleError("turn_ends", f"end {k} ({end}) is not past the previous one ({previous})")
        if not any(sample.loss_mask[max(previous, 1) : end]):
            raise InvalidSampleError(
                "turn_ends", f"span {k} [{previous}, {end}) has no trainable token (a reward there trains nothing)"
            )
        previous = end
    if previous != n:
        raise InvalidSampleError("turn_ends", f"the last span ends at {previous}, not at len(tokens) {n}")


def _check_cookbook_fields(sample: RolloutSample, n: int) -> None:
    """The current cookbook's optional fields: `raw_logprobs` one number per token; `prompt_model_input` text whose
    tokens are the prompt's (those before the first trained token)."""
    raw = sample.raw_logprobs
    if raw is not None:
        if not isinstance(raw, list | tuple) or len(raw) != n:
            got = f"length {len(raw)}" if isinstance(raw, list | tuple) else type(raw).__name__
            raise InvalidSampleError("raw_logprobs", f"{got}; must be a list of len(tokens) {n} floats, or None")
        bad = next((i for i, v in enumerate(raw) if isinstance(v, bool) or not isinstance(v, int | float)), None)
        if bad is not None:
            raise InvalidSampleError("raw_logprobs", f"position {bad} is {raw[bad]!r}, not a float")
    model_input = sample.prompt_model_input
    if model_input is None:
        return
    to_ints = getattr(model_input, "to_ints", None)
    if not callable(to_ints):
        raise InvalidSampleError("prompt_model_input", f"must be a tinker ModelInput or None, got {type(model_input)}")
    try:
        prompt = [int(t) for t in to_ints()]
    except (TypeError, ValueError) as exc:
        raise InvalidSampleError(
            "prompt_model_input",
            f"holds more than token ids ({exc}): multimodal inputs are not supported, fleetrl trains on token ids only",
        ) from None
    prompt_len = next(i for i, m in enumerate(sample.loss_mask) if m)
    if prompt != list(sample.tokens[:prompt_len]):
        raise InvalidSampleError(
            "prompt_model_input",
            f"its {len(prompt)} tokens are not the sample's {prompt_len} tokens before the first trained one",
        )


@dataclass
class RolloutSetup:
    """What the rollout factory receives once per gateway.

    Attributes:
        tokenizer: the run's tokenizer (a transformers tokenizer), for chat templates and decoding.
        sampler: the inference client (filled by the gateway), with the Fireworks-cookbook interface
            `sample_with_prompt_tokens(...)` / `sample_with_tokens(messages=...)`
            (`fleetrl.gateway.sampler.SamplerLike`).
        sample_kwargs: the run's sampling settings (max_tokens, temperature, top_p, top_k).
        completions_per_prompt: G, the group size.
        extras: free-form values from the config (`rollout_extras`).
        max_seq_len: the longest trajectory the trainer takes; longer samples are dropped and counted.
        model: the model name an OpenAI-SDK agent passes (the cookbook's `model`).
        tokenizer_id: the run's tokenizer path or hub id (the cookbook's `tokenizer_id`).
        inference_base_url, api_key: the gateway's OpenAI endpoint and its key (the cookbook's fields), set from the
            start when the setup is made on a running event loop (every gateway and `fleetrl eval` make it so; the
            port is bound then, the server starts at the first call), else at the first `open_session()`. Calls
            there are served, not recorded; each reply carries its exact prompt and completion token ids, logprobs
            and versions, so a rollout that builds its sample from them trains exactly what was generated.
        sessions: the agent session server (fleetrl.gateway.session_server), filled by the gateway.
        judge_sampler, judge_base_url, judge_model, judge_api_key: the judge pool ([up] judge_model: frozen inference
            replicas of another model, never sent weights) as a sampler with this interface and as an OpenAI
            endpoint (fleetrl.gateway.judge); None without a judge.
    """

    tokenizer: Any = None
    sampler: SamplerLike | None = None
    sample_kwargs: dict[str, Any] = field(default_factory=dict)
    completions_per_prompt: int = 2
    extras: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int | None = None
    model: str = "policy"
    tokenizer_id: str = ""
    inference_base_url: str | None = None
    api_key: str | None = None
    sessions: Any = None
    judge_sampler: SamplerLike | None = None
    judge_base_url: str | None = None
    judge_model: str | None = None
    judge_api_key: str | None = None

    async def open_session(self, *, exact_history: bool = False) -> AgentSession:
        """A per-sample OpenAI endpoint that records every model call (fleetrl.agent_session): hand
        `session.base_url`, `session.api_key` and `session.model` to an OpenAI-SDK agent, then return
        `session.to_rollout_run(reward=...)`. `exact_history`: a call that extends the previous one is appended as
        tokens, so the model sees exactly what it generated and the turns join."""
        if self.sessions is None:
            raise RuntimeError(
                "open_session: this RolloutSetup has no session server; it is filled by the rollout gateway and "
                "fleetrl eval (RolloutSetup.for_run)"
            )
        session = await self.sessions.open(exact_history=exact_history)
        self.inference_base_url, self.api_key = self.sessions.base_url, self.sessions.api_key
        return session

    @classmethod
    def for_run(cls, run: Config, tokenizer: Any, sampler: SamplerLike) -> RolloutSetup:
        """The setup every gateway (and `fleetrl eval`) hands the rollout factory: the run's settings around
        `tokenizer` and `sampler`."""
        from fleetrl.gateway.session_limits import SessionLimits
        from fleetrl.gateway.session_server import SessionServer

        max_seq_len = resolve_max_seq_len(run)
        tokenizer_id = str(run.tokenizer_model or run.base_model)
        sessions = SessionServer(
            sampler,
            tokenizer,
            model=SESSION_MODEL_NAME,
            tokenizer_id=tokenizer_id,
            sample_kwargs=dict(run.sample_kwargs),
            max_seq_len=max_seq_len,
            limits=SessionLimits.of_run(run),
        )
        base_url = api_key = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop to serve on (a synchronous caller): set at the first open_session()
            pass
        else:  # the cookbook's rollouts read these before (or without) opening a session
            base_url, api_key = sessions.listen(), sessions.api_key
        return cls(
            tokenizer=tokenizer,
            sampler=sampler,
            sample_kwargs=dict(run.sample_kwargs),
            completions_per_prompt=run.completions_per_prompt,
            extras=dict(run.rollout_extras),
            max_seq_len=max_seq_len,
            model=SESSION_MODEL_NAME,
            tokenizer_id=tokenizer_id,
            inference_base_url=base_url,
            api_key=api_key,
            sessions=sessions,
        )


class RolloutReturnTypeError(TypeError):
    """A rollout function returned something that is neither a RolloutSample, a RolloutRun, a list of them, nor None:
    a bug in the rollout code that stops the gateway (every sample would be dropped)."""


@dataclass
class RolloutSegment:
    """One stretch of a trajectory the trainer sees as one sequence: tokens with their logprobs and mask.

    Attributes:
        tokens: token ids of the segment (its observation, then what the policy generated, ...).
        logprobs: per-token sampler logprob; 0.0 where the policy did not generate.
        loss_mask: 1 on policy-generated tokens, 0 elsewhere.
        versions: policy version per token (None when unknown).
    """

    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    versions: list[int] | None = None


@dataclass
class RolloutRun:
    """One trajectory returned as segments (the cookbook's multi-segment return).

    Segments are joined in order: a segment whose tokens start with everything gathered so far (the next turn's
    observation extends the last one) adds only its new tokens to the same sample; one that does not starts a new
    sample. So an append-only multi-turn chat becomes one sample, and a trajectory whose observation is rewritten
    becomes several samples of the same group, each with the run's reward, finish reason and metrics. Group
    advantages are computed over samples, so a run split into k samples counts k times in its group's mean and std
    (exact per-trajectory advantages would need the trainer to know which samples share a trajectory).

    The cookbook's form works as written: ``RolloutRun(segments=[RolloutSample(..., reward=r), ...])`` with no
    ``reward=`` takes the trajectory's reward from its segments, which must all carry the same one (as the
    cookbook requires), and the last segment's ``finish_reason`` and ``text``.

    Attributes:
        segments: RolloutSegment or RolloutSample, in order.
        reward: scalar reward of the whole trajectory; None = the segments' (one shared) reward.
        finish_reason, text, metrics: as on `RolloutSample` (text and finish_reason go to the last sample).
        run_id, metadata: the cookbook's optional labels; kept for the user, not trained on.
        turn_rewards: optional reward per segment (a segment is a turn: its new tokens up to the next segment's),
            beside the total `reward`; each sample of the run gets those of its segments as
            `RolloutSample.turn_rewards` with `turn_ends` at the segments' ends, so turn-level estimators
            (`turn_discounted`) credit each turn by its own reward and what follows it. A segment with no trainable
            token of its own cannot carry a reward (the sample is invalid, naming turn_ends).
    """

    segments: list[Any]
    reward: float | None = None
    finish_reason: str = "stop"
    text: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None
    metadata: dict[str, Any] | None = None
    turn_rewards: list[float] | None = None

    def _reward_and_ending(self) -> tuple[float, str, str]:
        """The run's reward, finish reason and text; from its RolloutSample segments when not given."""
        if self.reward is not None:
            return self.reward, self.finish_reason, self.text
        rewards = [getattr(seg, "reward", None) for seg in self.segments]
        for i, reward in enumerate(rewards):
            if not isinstance(reward, int | float) or isinstance(reward, bool):
                raise InvalidSampleError(
                    f"segments[{i}].reward",
                    "a RolloutRun without reward= takes it from its segments, and this one has none: pass "
                    "RolloutRun(..., reward=r) or RolloutSample segments",
                )
            if float(reward) != float(rewards[0]):
                raise InvalidSampleError(
                    f"segments[{i}].reward",
                    f"{reward} differs from segment 0's {rewards[0]}; a run has one trajectory-level reward: "
                    "put the same on every segment",
                )
        last = self.segments[-1]
        finish = getattr(last, "finish_reason", None) if self.finish_reason == "stop" else self.finish_reason
        text = self.text or getattr(last, "text", "") or ""
        return float(rewards[0]), finish if isinstance(finish, str) else "stop", text

    def to_samples(self) -> list[RolloutSample]:
        """The run as trainable samples (see the class docstring); raises `InvalidSampleError` for a bad segment."""
        if not isinstance(self.segments, list | tuple) or not self.segments:
            raise InvalidSampleError("segments", "a RolloutRun needs at least one segment")
        reward, finish_reason, text = self._reward_and_ending()
        # RolloutSample segments may carry metrics (the cookbook's form); the run's own metrics win.
        metrics = {k: v for seg in self.segments for k, v in (getattr(seg, "metrics", None) or {}).items()}
        metrics.update(self.metrics)
        turn_rewards = self.turn_rewards
        if turn_rewards is not None and (
            not isinstance(turn_rewards, list | tuple) or len(turn_rewards) != len(self.segments)
        ):
            got = f"{len(turn_rewards)} rewards" if isinstance(turn_rewards, list | tuple) else repr(turn_rewards)
            raise InvalidSampleError(
                "turn_rewards", f"a RolloutRun's turn_rewards has one per segment ({len(self.segments)}), got {got}"
            )
        merged: list[RolloutSegment] = []
        ends: list[list[int]] = []  # per merged sample: where each of its segments ends
        owners: list[int] = []  # the merged sample of each segment
        for i, seg in enumerate(self.segments):
            for name in ("tokens", "logprobs", "loss_mask"):
                if not isinstance(getattr(seg, name, None), list | tuple):
                    raise InvalidSampleError(f"segments[{i}].{name}", "missing or not a list")
            tokens, logprobs, mask = list(seg.tokens), list(seg.logprobs), list(seg.loss_mask)
            versions = getattr(seg, "versions", None)
            versions = list(versions) if versions is not None else None
            last = merged[-1] if merged else None
            if last is not None and len(tokens) > len(last.tokens) and tokens[: len(last.tokens)] == last.tokens:
                n = len(last.tokens)  # extends: keep what the earlier segment said about the shared prefix
                last.tokens += tokens[n:]
                last.logprobs += logprobs[n:]
                last.loss_mask += mask[n:]
                if last.versions is not None and versions is not None:
                    last.versions += versions[n:]
                else:
                    last.versions = None
            else:
                merged.append(RolloutSegment(tokens, logprobs, mask, versions))
                ends.append([])
            ends[-1].append(len(merged[-1].tokens))
            owners.append(len(merged) - 1)
        per_sample: list[list[float] | None] = [None] * len(merged)
        if turn_rewards is not None:
            per_sample = [[r for r, o in zip(turn_rewards, owners, strict=True) if o == j] for j in range(len(merged))]
        return [
            RolloutSample(
                tokens=seg.tokens,
                logprobs=seg.logprobs,
                loss_mask=seg.loss_mask,
                reward=reward,
                finish_reason=finish_reason if i == len(merged) - 1 else "stop",
                text=text if i == len(merged) - 1 else "",
                versions=seg.versions,
                metrics=dict(metrics),
                turn_rewards=per_sample[i],
                turn_ends=None if per_sample[i] is None else ends[i],
            )
            for i, seg in enumerate(merged)
        ]


def rollout_result_samples(result: Any) -> list[RolloutSample] | None:
    """What one rollout call returned, as samples: None stays None (dropped), a RolloutSample is one sample, a
    RolloutRun its samples. Anything else raises `RolloutReturnTypeError` naming the type."""
    if result is None or isinstance(result, RolloutSample):
        return None if result is None else [result]
    if isinstance(result, RolloutRun):
        return result.to_samples()
    raise RolloutReturnTypeError(
        f"the rollout function returned {type(result).__module__}.{type(result).__qualname__}; it must return a "
        "RolloutSample, a RolloutRun or None (fleetrl.rollout)"
    )


ROLLOUT_CONTEXT_ARGS: tuple[str, ...] = (
    "cursor_index",
    "epoch",
    "rollout_idx",
    "evaluation",
    "row_id",
    "submit_version",
    "attempt",
    "row_index",
    "sample_index",
    "end_of_epoch",
)
"""Keyword arguments a rollout function receives when it declares them (or takes **kwargs): cursor_index (the
row's index in the dataset), epoch, rollout_idx (0..G-1 within the group), evaluation (False for training rows),
row_id (the controller's id: epoch * rows + cursor_index), submit_version (the policy version the row was admitted
at), attempt (the lease attempt, 1 on first lease), and the current cookbook's row_index (the row's index within
its epoch: fleetrl's cursor_index), sample_index (= rollout_idx) and end_of_epoch (True for an epoch's last row).
The cookbook's own cursor_index counts across epochs: that is fleetrl's row_id."""

DATASET_CONTEXT_ARGS: frozenset[str] = frozenset({"cursor_index", "epoch", "row_index", "end_of_epoch"})
"""The context arguments that need the dataset's size (a row id -> its epoch and index within it)."""


def declared_context_args(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The context keyword arguments `fn` declares (all of them when it takes **kwargs); inspected once."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: give it nothing extra
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ROLLOUT_CONTEXT_ARGS
    return tuple(name for name in ROLLOUT_CONTEXT_ARGS if name in params)


EvaluationShape = Literal["step_rollout_fn", "setup_rows"]
_STEP_NAMES = frozenset({"step", "global_step", "version"})
_ROLLOUT_NAMES = frozenset({"rollout_fn", "rollout", "evaluation_rollout_fn"})
_SETUP_NAMES = frozenset({"setup", "rollout_setup"})
_ROWS_NAMES = frozenset({"rows", "eval_rows"})


def _annotated_as(param: inspect.Parameter, name: str) -> bool:
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return text == name or text.endswith(f".{name}")


def evaluation_call_shape(fn: Callable[..., Any]) -> EvaluationShape:
    """How the evaluation hook `fn` is called, read from its first two parameters: `"step_rollout_fn"` for the
    current cookbook's `evaluation_fn(step, rollout_fn)`, `"setup_rows"` for fleetrl's `evaluate(setup, rows)`.
    A parameter named step / global_step / version or annotated int, or a second one named rollout_fn says the
    cookbook's; setup (or annotated RolloutSetup) or rows says fleetrl's. `ValueError` naming evaluation_fn when
    the signature says neither (or both)."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    shapes = "evaluation_fn(step, rollout_fn) (the current cookbook's) or evaluation_fn(setup, rows) (fleetrl's)"
    if len(params) < 2:
        raise ValueError(f"evaluation_fn: it must take two positional arguments: {shapes}")
    first, second = params[:2]
    cookbook = first.name in _STEP_NAMES or _annotated_as(first, "int") or second.name in _ROLLOUT_NAMES
    fleetrl = first.name in _SETUP_NAMES or _annotated_as(first, "RolloutSetup") or second.name in _ROWS_NAMES
    if cookbook and not fleetrl:
        return "step_rollout_fn"
    if fleetrl and not cookbook:
        return "setup_rows"
    raise ValueError(
        f"evaluation_fn: cannot tell from its parameters ({first.name}, {second.name}) whether it is called as "
        f"{shapes}; name them so"
    )


def make_evaluation_rollout_fn(rollout_fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """The rollout function handed to a cookbook-shaped `evaluation_fn(step, rollout_fn)`, as the cookbook's
    `make_evaluation_rollout_fn`: `await rollout_fn(row, **context)` calls the user's rollout with `evaluation=True`
    and, of `context`, the arguments it declares."""
    names = declared_context_args(rollout_fn)

    async def evaluation_rollout_fn(sample_prompt: dict[str, Any], **context: Any) -> Any:
        context["evaluation"] = True
        return await rollout_fn(sample_prompt, **{name: context[name] for name in names if name in context})

    return evaluation_rollout_fn


def group_rollout(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as a group rollout: `async fn(row, n) -> Sequence[result]` is called once per row and returns the
    n results of the group together, so it can score the whole group at once (the Tinker adapter does)."""
    fn.__fleetrl_group_rollout__ = True  # type: ignore[attr-defined]
    return fn


def is_group_rollout(fn: Any) -> bool:
    return bool(getattr(fn, "__fleetrl_group_rollout__", False))


RolloutFn = Callable[[dict[str, Any]], Awaitable[RolloutSample | RolloutRun | None]]
RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]
