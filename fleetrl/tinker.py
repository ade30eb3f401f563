"""Tinker environments as a fleetrl rollout: one dataset row is one `EnvGroupBuilder`, its G envs the row's group.

    from fleetrl.tinker import tinker_rollout_fn

    def make_rollout_fn(setup):                  # the factory the gateways import (fleetrl up / fleetrl.main)
        return tinker_rollout_fn(setup, builder_for_row)   # builder_for_row(row) -> EnvGroupBuilder

With an `RLDataset`, `dataset_rows(dataset)` gives the rows ({"tinker_batch": i, "tinker_index": j}) and
`builder_from_dataset(dataset)` the `builder_for_row`. The adapter follows tinker-cookbook's `rl/types.py` without
importing it (tinker-cookbook is optional: its real `Trajectory`/`Transition` classes are used when it is
installed, same-shaped dataclasses otherwise):

- each env runs `initial_observation()`, then sample -> `step(action)` until `episode_done`; observations are
  `ModelInput`s (`to_ints()`) or token lists, stop conditions strings (cut by the sampler) or token ids;
- `compute_group_rewards(trajectories, envs)` runs once, on the whole group, after every env finished (the gateway
  calls the adapter once per row: `fleetrl.rollout.group_rollout`); an env that raised is left out of it, as in
  tinker-cookbook's error-tolerant rollouts, and its member is dropped;
- a trajectory's reward is the sum of its step rewards plus its group reward; its transitions become the segments
  of a `RolloutRun` (a turn whose observation extends the previous turn joins its sample);
- metrics: step and group metrics, the total as `reward/total`, each also under every `logging_tags()` tag:
  `env/<tag>/<name>` in the step's metrics next to `env/all/<name>`;
- a sampling outage (no replica, an RPC error, a timeout) raises out of the adapter, so the gateway retries the
  whole group; `cleanup()` runs after every group.

Without tinker-cookbook installed, `Env`, `EnvGroupBuilder`, `RLDataset`, `StepResult` and `ModelInput` here stand
in for tinker's (same names and methods), so Tinker env code ports by changing its imports
(examples/tinker_env).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.gateway.sampling_seed import member_seed_scope
from fleetrl.rollout import RolloutRun, RolloutSegment, RolloutSetup, group_rollout

BuilderForRow = Callable[[dict[str, Any]], Any]
OUTAGE_ERRORS = ("NoReplicaError", "AioRpcError")
"""Exception type names that mean the sampler, not the env, failed: the group is retried by the gateway."""


@dataclass
class TokensWithLogprobs:
    """An action: the sampled tokens and their logprobs (tinker_cookbook.completers.TokensWithLogprobs)."""

    tokens: list[int]
    maybe_logprobs: list[float] | None = None


@dataclass
class Transition:
    """One step of a trajectory (tinker_cookbook.rl.types.Transition)."""

    ob: Any
    ac: TokensWithLogprobs
    reward: float
    episode_done: bool
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    """A finished episode (tinker_cookbook.rl.types.Trajectory)."""

    transitions: list[Any]
    final_ob: Any
    stop_reason: str | None = None


@dataclass
class ModelInput:
    """Stands in for `tinker.ModelInput` (token chunks): here one list of token ids."""

    tokens: list[int]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls([int(t) for t in tokens])

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class StepResult:
    """What `Env.step` returns (tinker_cookbook.rl.types.StepResult)."""

    reward: float
    episode_done: bool
    next_observation: Any
    next_stop_condition: Any
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, Any] = field(default_factory=dict)


class Env:
    """One single-use episode (tinker_cookbook.rl.types.Env): override `initial_observation` and `step`."""

    async def initial_observation(self) -> tuple[Any, Any]:
        raise NotImplementedError

    async def step(self, action: list[int], *, extra: dict[str, Any] | None = None) -> StepResult:
        raise NotImplementedError


class EnvGroupBuilder:
    """Builds the envs of one group (tinker_cookbook.rl.types.EnvGroupBuilder): override `make_envs`."""

    async def make_envs(self) -> Sequence[Env]:
        raise NotImplementedError

    async def compute_group_rewards(self, trajectory_group: list[Any], env_group: Sequence[Any]) -> list[Any]:
        return [(0.0, {}) for _ in trajectory_group]

    async def cleanup(self) -> None:
        return None

    def logging_tags(self) -> list[str]:
        return []


class RLDataset:
    """Batches of EnvGroupBuilders (tinker_cookbook.rl.types.RLDataset): override `get_batch` and `__len__`."""

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


def _tinker_types() -> tuple[type, type, type]:
    """tinker-cookbook's own data classes when it is installed (a builder may check isinstance), else ours."""
    try:
        from tinker_cookbook.completers import TokensWithLogprobs as TinkerTokens
        from tinker_cookbook.rl.types import Trajectory as TinkerTrajectory
        from tinker_cookbook.rl.types import Transition as TinkerTransition
    except ImportError:
        return TokensWithLogprobs, Transition, Trajectory
    return TinkerTokens, TinkerTransition, TinkerTrajectory


def observation_tokens(ob: Any) -> list[int]:
    """The token ids of an observation: a `ModelInput` (`to_ints()`, or text chunks' `tokens`) or a list of ints."""
    if hasattr(ob, "to_ints"):
        return [int(t) for t in ob.to_ints()]
    if isinstance(ob, list | tuple):
        return [int(t) for t in ob]
    chunks = getattr(ob, "chunks", None)
    if chunks is not None:
        tokens: list[int] = []
        for chunk in chunks:
            if not hasattr(chunk, "tokens"):
                raise TypeError(f"observation chunk {type(chunk).__name__} has no tokens (images are not supported)")
            tokens.extend(int(t) for t in chunk.tokens)
        return tokens
    raise TypeError(f"observation of type {type(ob).__name__}: expected a ModelInput or a list of token ids")


def stop_arguments(stop: Any) -> dict[str, Any]:
    """A tinker StopCondition (stop strings or stop token ids) as sampler arguments."""
    items = list(stop or [])
    if not items:
        return {}
    if all(isinstance(x, str) for x in items):
        return {"stop": items}
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return {"stop_token_ids": tuple(items)}
    raise TypeError(f"stop condition {stop!r}: expected a list of strings or a list of token ids")


def tagged_metrics(metrics: dict[str, float], tags: Sequence[str]) -> dict[str, float]:
    """`metrics` plus a copy of each under `env/<tag>/<name>` for every logging tag."""
    out = dict(metrics)
    for tag in tags:
        out.update({f"env/{tag}/{name}": value for name, value in metrics.items()})
    return out


def _takes_extra(env: Any) -> bool:
    try:
        return "extra" in inspect.signature(env.step).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class EnvRun:
    """One env's finished episode: its trajectory (tinker shape) and what the trainer needs from it."""

    trajectory: Any
    segments: list[RolloutSegment]
    step_reward: float
    metrics: dict[str, float]
    finish_reason: str = "stop"
    text: str = ""


async def run_env(env: Any, sampler: Any, sample_kwargs: dict[str, Any], max_turns: int = 64) -> EnvRun:
    """Run one env to the end of its episode through `sampler` (the cookbook interface)."""
    tokens_cls, transition_cls, trajectory_cls = _tinker_types()
    first = await env.initial_observation()
    if not isinstance(first, tuple):  # InitialObservationOverflow: the prompt is too long, no sampling
        reward, metrics = float(first.reward), dict(getattr(first, "metrics", {}) or {})
        trajectory = trajectory_cls(transitions=[], final_ob=None)
        return EnvRun(trajectory, [], reward, metrics, "length")
    ob, stop = first
    pass_extra = _takes_extra(env)
    transitions: list[Any] = []
    segments: list[RolloutSegment] = []
    total, metrics, finish, text = 0.0, {}, "stop", ""
    for _ in range(max_turns):
        prompt = observation_tokens(ob)
        (completion,) = await sampler.sample_with_prompt_tokens(prompt, n=1, **sample_kwargs, **stop_arguments(stop))
        action = list(completion.completion_tokens)
        logprobs = list(completion.inference_logprobs)
        finish, text = completion.finish_reason, completion.text
        first_version = completion.versions[0] if completion.versions else 0
        segments.append(
            RolloutSegment(
                tokens=prompt + action,
                logprobs=[0.0] * len(prompt) + logprobs,
                loss_mask=[0] * len(prompt) + [1] * len(action),
                versions=[first_version] * len(prompt) + list(completion.versions),
            )
        )
        extra = {"stop_reason": finish}
        result = await (env.step(action, extra=extra) if pass_extra else env.step(action))
        reward = float(result.reward)
        total += reward
        step_metrics = {k: float(v) for k, v in dict(getattr(result, "metrics", {}) or {}).items()}
        metrics.update(step_metrics)
        transitions.append(
            transition_cls(
                ob=ob,
                ac=tokens_cls(tokens=action, maybe_logprobs=logprobs),
                reward=reward,
                episode_done=bool(result.episode_done),
                metrics=step_metrics,
                logs=dict(getattr(result, "logs", {}) or {}),
            )
        )
        if result.episode_done:
            return EnvRun(
                trajectory_cls(transitions=transitions, final_ob=result.next_observation),
                segments,
                total,
                metrics,
                finish,
                text,
            )
        ob, stop = result.next_observation, result.next_stop_condition
    raise RuntimeError(f"the env did not end its episode within {max_turns} turns (tinker_max_turns)")


async def run_group(
    builder: Any, sampler: Any, sample_kwargs: dict[str, Any], n: int, max_turns: int = 64
) -> list[Any]:
    """The n results of one EnvGroupBuilder: a `RolloutRun` per env, or the exception an env raised."""
    envs = list(await builder.make_envs())
    try:
        if len(envs) != n:
            raise ValueError(
                f"the EnvGroupBuilder made {len(envs)} envs but completions_per_prompt is {n}: set "
                f"completions_per_prompt = {len(envs)}"
            )

        async def member(i: int, env: Any) -> EnvRun:
            with member_seed_scope(i):
                return await run_env(env, sampler, sample_kwargs, max_turns)

        runs = await asyncio.gather(*(member(i, env) for i, env in enumerate(envs)), return_exceptions=True)
        for run in runs:  # the sampler failed, not the env: let the gateway retry the group
            if isinstance(run, BaseException) and (
                type(run).__name__ in OUTAGE_ERRORS or isinstance(run, TimeoutError | asyncio.CancelledError)
            ):
                raise run
        done = [i for i, run in enumerate(runs) if isinstance(run, EnvRun)]
        group = await builder.compute_group_rewards([runs[i].trajectory for i in done], [envs[i] for i in done])
        if len(group) != len(done):
            raise ValueError(f"compute_group_rewards returned {len(group)} rewards for {len(done)} trajectories")
        tags = list(builder.logging_tags()) if hasattr(builder, "logging_tags") else []
        results: list[Any] = list(runs)
        for i, (group_reward, group_metrics) in zip(done, group, strict=True):
            run = runs[i]
            total = run.step_reward + float(group_reward)
            metrics = {**run.metrics, **{k: float(v) for k, v in dict(group_metrics).items()}, "reward/total": total}
            if not run.segments:  # an overflowed prompt: compute_group_rewards saw it, but it has no tokens to
                # train, so it is dropped (advantages are over trained samples; tinker also centers on it)
                results[i] = None
                continue
            results[i] = RolloutRun(run.segments, total, run.finish_reason, run.text, tagged_metrics(metrics, tags))
        return results
    finally:
        if hasattr(builder, "cleanup"):
            await builder.cleanup()


def tinker_rollout_fn(
    setup: RolloutSetup, builder_for_row: BuilderForRow, *, max_turns: int | None = None
) -> Callable[[dict[str, Any], int], Awaitable[list[Any]]]:
    """A fleetrl rollout function that runs `builder_for_row(row)`'s envs (a group rollout: called once per row).
    `builder_for_row` may be async. `max_turns` (or `rollout_extras.tinker_max_turns`, default 64) bounds an
    episode."""
    turns = int(max_turns or setup.extras.get("tinker_max_turns", 64))

    @group_rollout
    async def rollout_fn(row: dict[str, Any], n: int) -> list[Any]:
        builder = builder_for_row(row)
        if inspect.isawaitable(builder):
            builder = await builder
        return await run_group(builder, setup.sampler, dict(setup.sample_kwargs), n, turns)

    return rollout_fn


def dataset_rows(dataset: Any) -> list[dict[str, int]]:
    """One row per EnvGroupBuilder of an RLDataset (`get_batch(i)`, `len`): {"tinker_batch": i, "tinker_index": j}."""
    return [
        {"tinker_batch": i, "tinker_index": j} for i in range(len(dataset)) for j in range(len(dataset.get_batch(i)))
    ]


def builder_from_dataset(dataset: Any) -> BuilderForRow:
    """`builder_for_row` for rows made by `dataset_rows(dataset)`."""
    batches: dict[int, Sequence[Any]] = {}

    def builder_for_row(row: dict[str, Any]) -> Any:
        i = int(row["tinker_batch"])
        if i not in batches:
            batches[i] = dataset.get_batch(i)
        return batches[i][int(row["tinker_index"])]

    return builder_for_row
