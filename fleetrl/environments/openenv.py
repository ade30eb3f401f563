"""OpenEnv environments as fleetrl rollouts: `environment = "openenv:<server URL>"`.

An OpenEnv (openenv-core 0.3.0) environment is a server (`openenv.core.env_server.create_app`) that a client drives
with `reset()` and `step(action)` over a WebSocket session, each step returning an observation, a reward and `done`.
This adapter plays one episode per rollout with openenv-core's own client (`GenericEnvClient`) and the policy behind
an agent session (`setup.open_session()`): the observation becomes the user's message, the model's reply becomes the
action, and so on until the environment says `done` (or `max_turns` replies). Every model call goes through the
session, so the trained tokens and logprobs are the ones the replica generated; the episode's reward is the sum of
its step rewards, and each step's reward is its turn's (`RolloutRun.turn_rewards`, for turn-level estimators);
`openenv_steps` and `openenv_done` are sample metrics.

Options (`rollout_extras.environment_options`):
- `action_field` (default "message"): the action's text field, filled with the model's reply; with
  `action_json = true` the reply is parsed as the whole action (a JSON object).
- `observation_field` (default: the observation's fields as JSON, less `reward`/`done`/`metadata`): the
  observation field shown to the model.
- `system_prompt`, `max_turns` (8), `message_timeout_s` (60).

Rows: `{"reset": {...}}`, the keyword arguments of `reset()` (a seed, a task id); `environment_rows` makes
`num_rows` (default 32) rows with seeds 0..n-1.

A failure (the server unreachable, a step refused, an action the reply cannot become) raises
`EnvironmentEpisodeError`: the gateway drops the sample and counts it (`producer/samples_dropped_error`).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from fleetrl.environments import EnvironmentEpisodeError, FailureCounts, record_session

if TYPE_CHECKING:
    from fleetrl.rollout import RolloutRun, RolloutSetup

HIDDEN_OBSERVATION_FIELDS = ("reward", "done", "metadata")
OPTIONS = ("action_field", "action_json", "observation_field", "system_prompt", "max_turns", "message_timeout_s")


def environment_rows(base_url: str, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`num_rows` rows `{"reset": {"seed": i}}`."""
    n = int((options or {}).get("num_rows", 32))
    if n < 1:
        raise ValueError(f"environment_options.num_rows must be >= 1, got {n}")
    return [{"reset": {"seed": i}} for i in range(n)]


def observation_text(observation: dict[str, Any], field: str | None) -> str:
    """What the model is shown of an observation: `field`'s value, or the visible fields as JSON."""
    if field is not None:
        if field not in observation:
            raise EnvironmentEpisodeError(
                f"observation has no field {field!r} (has {sorted(observation)})", "bad_observation"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    visible = {k: v for k, v in observation.items() if k not in HIDDEN_OBSERVATION_FIELDS}
    return json.dumps(visible)


def reply_action(reply: str, field: str, as_json: bool) -> dict[str, Any]:
    """The model's reply as an action: `{field: reply}`, or the reply parsed as a JSON object."""
    if not as_json:
        return {field: reply}
    try:
        action = json.loads(reply)
    except json.JSONDecodeError as exc:
        raise EnvironmentEpisodeError(
            f"the reply is not a JSON action ({exc}): {reply[:200]!r}", "bad_action"
        ) from None
    if not isinstance(action, dict):
        raise EnvironmentEpisodeError(f"the reply is JSON but not an object: {reply[:200]!r}", "bad_action")
    return action


class OpenEnvRollout:
    """The rollout function of one gateway: one OpenEnv episode per call, over an agent session."""

    def __init__(self, setup: RolloutSetup, base_url: str, options: dict[str, Any] | None = None) -> None:
        options = dict(options or {})
        options.pop("num_rows", None)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"environment_options: unknown option(s) {unknown}; known: {', '.join(OPTIONS)}")
        if not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"environment: openenv:<server URL> needs an http(s) or ws(s) URL, got {base_url!r}")
        self.setup, self.base_url = setup, base_url
        self.action_field = str(options.get("action_field", "message"))
        self.action_json = bool(options.get("action_json", False))
        self.observation_field = options.get("observation_field")
        self.system_prompt = options.get("system_prompt")
        self.max_turns = int(options.get("max_turns", 8))
        self.message_timeout_s = float(options.get("message_timeout_s", 60.0))
        if self.max_turns < 1:
            raise ValueError(f"environment_options.max_turns must be >= 1, got {self.max_turns}")
        self.failures = FailureCounts(f"openenv:{base_url}")

    async def close(self) -> None:
        """Nothing held between episodes (each opens its own WebSocket session)."""

    async def __call__(self, row: dict[str, Any]) -> RolloutRun:
        try:
            return await self._play(row)
        except EnvironmentEpisodeError as exc:
            self.failures.record(exc)
            raise

    async def _play(self, row: dict[str, Any]) -> RolloutRun:
        import openai
        from openenv import GenericEnvClient

        reset = row.get("reset", {})
        if not isinstance(reset, dict):
            raise ValueError(f"row {row!r}: reset must be an object (reset()'s keyword arguments)")
        session = await self.setup.open_session()
        step_rewards: list[float] = []
        done = False
        env = GenericEnvClient(base_url=self.base_url, message_timeout_s=self.message_timeout_s)
        try:
            await env.connect()
            result = await env.reset(**reset)
            messages: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}] * bool(
                self.system_prompt
            )
            messages.append({"role": "user", "content": observation_text(result.observation, self.observation_field)})
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as llm:
                for _ in range(self.max_turns):
                    reply = await llm.chat.completions.create(model=session.model, messages=messages)  # type: ignore[arg-type]
                    text = reply.choices[0].message.content or ""
                    messages.append({"role": "assistant", "content": text})
                    result = await env.step(reply_action(text, self.action_field, self.action_json))
                    step_rewards.append(float(result.reward or 0.0))
                    done = bool(result.done)
                    if done:
                        break
                    messages.append(
                        {"role": "user", "content": observation_text(result.observation, self.observation_field)}
                    )
        except EnvironmentEpisodeError:
            raise
        except (openai.APIError, ConnectionError, OSError, TimeoutError, RuntimeError, ValueError) as exc:
            # the server unreachable or refusing a step, a reply the session refused (a prompt past max_seq_len)
            raise EnvironmentEpisodeError(
                f"openenv episode at {self.base_url} failed: {type(exc).__name__}: {exc}", type(exc).__name__
            ) from exc
        finally:
            await env.disconnect()
        reward = sum(step_rewards)
        if not math.isfinite(reward):
            raise EnvironmentEpisodeError(
                f"openenv episode: reward {reward} is not finite ({step_rewards})", "non_finite_reward"
            )
        run = session.to_rollout_run(reward=reward)
        if len(run.segments) == len(step_rewards):  # one segment per model call, one step per call
            run.turn_rewards = list(step_rewards)  # each turn credited by its own step reward (turn-level estimators)
        run.metrics = {**run.metrics, "openenv_steps": float(len(step_rewards)), "openenv_done": float(done)}
        if record_path := self.setup.extras.get("record_path"):
            record_session(record_path, session, run)
        return run
