"""verifiers environments as fleetrl rollouts: `environment = "verifiers:<taskset id>"`.

A verifiers (0.4.0, `verifiers.v1`) environment brings its dataset (a `Taskset`), its rubric (the task's `@vf.reward`
methods and judges) and its multi-turn logic (an `Env`'s `run()`). This adapter runs one episode per rollout with the
environment's own code, and points the episode's model client at an agent session (`setup.open_session()`), so each
model call is recorded by fleetrl's session server: the trained tokens and logprobs are the ones the replica
generated, never verifiers' re-tokenisation of the messages. The episode's reward (the sum of its weighted rewards,
`Trace.reward`) is the sample's reward; each named reward and metric is a sample metric (`env/all/<name>`).

An episode that fails (an `Env`/`Task`/harness error, a timeout, scoring that did not run) raises
`EnvironmentEpisodeError` naming verifiers' error: the gateway drops the sample and counts it
(`producer/samples_dropped_error`), logging the traceback once per error type, as for any rollout that raises.

Rows: one per task of the taskset, `{"task_idx": i}` (`environment_rows`, or `python -m fleetrl.environments rows
verifiers:<id> rows.jsonl`); each gateway loads the same taskset and finds row i's task by its position.

Harness: a taskset that ships its own harness keeps it; otherwise the seats run
`fleetrl.environments.verifiers_chat` (registered as `fleetrl_verifiers_chat`: one in-process chat completion per
turn, on a local runtime) instead of verifiers' default `bash` program in a Prime sandbox, which installs itself with
uv at the first rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import os
from typing import TYPE_CHECKING, Any

from fleetrl.environments import EnvironmentEpisodeError, FailureCounts, record_session

if TYPE_CHECKING:
    from fleetrl.rollout import RolloutRun, RolloutSetup

SESSION_KEY_VAR = "FLEETRL_VERIFIERS_SESSION_KEY"
EPISODES_PER_SERVING = 256
"""Episodes per verifiers serving context (see `VerifiersRollout`): bounds the model clients it holds."""


def env_config(taskset_id: str, options: dict[str, Any] | None = None) -> Any:
    """The verifiers `EnvConfig` for `taskset_id` (an importable module exporting a `Taskset`, and optionally an
    `Env` and a `Harness`), with `options` as the taskset config's fields; seats without a harness of their own get
    the in-process chat harness unless the taskset ships one."""
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    from fleetrl.environments.verifiers_chat import register

    if not taskset_id:
        raise ValueError("environment: 'verifiers:' needs a taskset id (an importable module), e.g. verifiers:my_env")
    try:
        importlib.import_module(taskset_id.replace("-", "_"))
    except ModuleNotFoundError as exc:
        raise ValueError(f"environment: verifiers taskset {taskset_id!r} is not importable ({exc})") from None
    config_cls = env_config_type(taskset_id)
    config = config_cls.model_validate({"taskset": {"id": taskset_id, **(options or {})}})
    if default_harness_id(taskset_id) == "bash":  # the taskset ships no harness: pin ours on every unpinned seat
        updates = {}
        for name, field in type(config).model_fields.items():
            seat = getattr(config, name)
            if field.annotation is not None and hasattr(seat, "harness") and seat.harness is None:
                # verifiers' default runtime is a remote sandbox (Prime); the in-process harness needs none, and a
                # local runtime keeps the episode's interception on the loopback (no tunnel)
                runtime = seat.runtime.model_dump() if "runtime" in seat.model_fields_set else {"type": "subprocess"}
                updates[name] = {**seat.model_dump(), "harness": {"id": register()}, "runtime": runtime}
        if updates:
            config = config_cls.model_validate({**config.model_dump(), **updates})
    return config


def load_env(taskset_id: str, options: dict[str, Any] | None = None) -> Any:
    """The verifiers `Env` for `taskset_id` (see `env_config`)."""
    from verifiers.v1.utils.loaders import load_environment

    return load_environment(env_config(taskset_id, options))


def environment_rows(taskset_id: str, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per task of the taskset: `{"task_idx": i}`."""
    taskset = load_env(taskset_id, options).taskset
    if not taskset.bounded:
        raise ValueError(f"verifiers taskset {taskset_id!r} is infinite: bound it (e.g. a num_tasks option) first")
    return [{"task_idx": i} for i, _ in enumerate(taskset)]


def episode_reward(episode: Any) -> tuple[float, dict[str, float]]:
    """The reward and metrics of a finished episode's trainable trace; raises EnvironmentEpisodeError for a failed
    episode (its first error named) or one whose scoring did not run."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        stops = [t.stop_condition for t in episode.traces if t.stop_condition]
        reasons = "; ".join(f"{e.type}: {e.message}" for e in errors) or f"stopped by {stops or 'nothing recorded'}"
        reason = errors[0].type if errors else "not_ok"
        raise EnvironmentEpisodeError(f"verifiers episode failed: {reasons[:2000]}", reason)
    traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)] or list(episode.traces)
    trace = traces[-1]
    missing = [name for name, r in trace.rewards.items() if r is None]
    if missing:
        raise EnvironmentEpisodeError(f"verifiers episode: rewards {missing} were not scored", "unscored")
    reward = float(trace.reward)
    if not math.isfinite(reward):
        raise EnvironmentEpisodeError(f"verifiers episode: reward {reward} is not finite", "non_finite_reward")
    metrics = {f"vf_{k}": float(r.value) for k, r in trace.rewards.items() if r is not None}
    metrics |= {f"vf_{k}": float(v) for k, v in trace.metrics.items() if v is not None}
    return reward, metrics


class _Serving:
    """One env's serving context (verifiers' interception server and shared tools) and the episodes on it."""

    def __init__(self, env: Any) -> None:
        self.env, self.stack = env, contextlib.AsyncExitStack()
        self.started = self.active = 0
        self.retired = False

    async def close(self) -> None:
        await self.stack.aclose()


class VerifiersRollout:
    """The rollout function of one gateway: one verifiers episode per call, over an agent session.

    verifiers' interception server keeps one model client per distinct endpoint for its lifetime, and every
    session has its own URL; so a serving context takes `episodes_per_serving` episodes, then a fresh env serves
    the next ones while the old context closes once its last episode is done (its clients with it)."""

    def __init__(
        self,
        setup: RolloutSetup,
        taskset_id: str,
        options: dict[str, Any] | None = None,
        episodes_per_serving: int = EPISODES_PER_SERVING,
    ) -> None:
        if episodes_per_serving < 1:
            raise ValueError(f"episodes_per_serving must be >= 1, got {episodes_per_serving}")
        self.setup, self.taskset_id, self.options = setup, taskset_id, options
        self.episodes_per_serving = episodes_per_serving
        self.env = load_env(taskset_id, options)
        self.tasks = list(self.env.taskset)
        self._current: _Serving | None = None
        self._lock = asyncio.Lock()
        self.servings_opened = 0
        self.failures = FailureCounts(f"verifiers:{taskset_id}")

    async def _acquire(self) -> _Serving:
        async with self._lock:
            current = self._current
            if current is None or current.started >= self.episodes_per_serving:
                if current is not None:
                    current.retired = True
                    if current.active == 0:
                        await current.close()
                env = self.env if self.servings_opened == 0 else load_env(self.taskset_id, self.options)
                current = _Serving(env)
                await current.stack.enter_async_context(env.serving())
                self._current, self.servings_opened = current, self.servings_opened + 1
            current.started += 1
            current.active += 1
            return current

    async def _release(self, serving: _Serving) -> None:
        async with self._lock:
            serving.active -= 1
            if serving.retired and serving.active == 0:
                await serving.close()

    async def close(self) -> None:
        """Stop the serving context (verifiers' interception server, shared tools)."""
        async with self._lock:
            if self._current is not None:
                self._current.retired = True
                if self._current.active == 0:
                    await self._current.close()
                self._current = None

    def task_for(self, row: dict[str, Any]) -> Any:
        idx = row.get("task_idx")
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(self.tasks):
            raise ValueError(f"row {row!r}: task_idx must be an index into the taskset's {len(self.tasks)} tasks")
        return self.tasks[idx]

    async def __call__(self, row: dict[str, Any]) -> RolloutRun:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig

        task = self.task_for(row)
        session = await self.setup.open_session()
        # verifiers reads an endpoint's key from an environment variable (never from its config); the session
        # key is one per gateway process, so one variable serves every session of this process
        os.environ[SESSION_KEY_VAR] = session.api_key
        client = EvalClientConfig(base_url=session.base_url, api_key_var=SESSION_KEY_VAR)
        serving = await self._acquire()
        try:
            episode = await serving.env.run_episode(task, ModelContext(model=session.model, client=client))
        finally:
            await self._release(serving)
        try:
            reward, metrics = episode_reward(episode)
        except EnvironmentEpisodeError as exc:
            self.failures.record(exc)
            raise
        run = session.to_rollout_run(reward=reward)
        run.metrics = {**run.metrics, **metrics}
        if record_path := self.setup.extras.get("record_path"):
            record_session(record_path, session, run)
        return run
