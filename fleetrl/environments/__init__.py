"""Environments users already have, run as fleetrl rollouts over agent sessions.

    [run.rollout_extras]
    environment = "verifiers:reverse_text"      # a verifiers taskset: an importable module
    environment_options = { num_tasks = 32 }    # its config's fields
    [up]
    rollout = "fleetrl.environments:make_rollout_fn"

`environment` is `<kind>:<what>`: `verifiers:<taskset id>` (fleetrl.environments.verifiers) or
`openenv:<module:attr of an OpenEnv client spec>` (fleetrl.environments.openenv). Every model call of an episode goes
through an agent session (`setup.open_session()`), so what is trained is exactly what the replica generated. An
episode that fails raises `EnvironmentEpisodeError`: the gateway drops that sample and counts it
(`producer/samples_dropped_error`), as for any rollout that raises.

The rows of such a run are the environment's tasks: `python -m fleetrl.environments rows verifiers:reverse_text
rows.jsonl` writes one row per task (`{"task_idx": i}`) for `[run] dataset`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetrl.agent_session import AgentSession
    from fleetrl.rollout import RolloutRun, RolloutSetup

log = logging.getLogger(__name__)
KINDS = ("verifiers", "openenv")


class EnvironmentEpisodeError(RuntimeError):
    """An environment's episode failed (its own error, a timeout, a reward not scored): the sample is dropped.
    `reason` is a short name of the kind of failure (verifiers' error type, `unscored`, `bad_action`, ...)."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class FailureCounts:
    """Failed episodes by reason, each reason logged (with its message) the first time it occurs: the gateway logs
    a traceback once per exception type, and every environment failure is an `EnvironmentEpisodeError`."""

    def __init__(self, source: str) -> None:
        self.source, self.counts = source, Counter[str]()

    def record(self, exc: EnvironmentEpisodeError) -> None:
        self.counts[exc.reason] += 1
        if self.counts[exc.reason] == 1:
            log.warning("%s: an episode failed (%s; later ones only counted): %s", self.source, exc.reason, exc)


def parse_environment(spec: str) -> tuple[str, str]:
    """`"<kind>:<target>"` -> (kind, target); ValueError names the field and what is wrong."""
    kind, sep, target = str(spec).partition(":")
    if not sep or kind not in KINDS or not target.strip():
        raise ValueError(f"environment = {spec!r}: expected one of {', '.join(k + ':<id>' for k in KINDS)}")
    return kind, target.strip()


def environment_rollout(spec: str, options: dict[str, Any] | None = None) -> Any:
    """A rollout factory (`setup -> rollout_fn`) for the environment `spec`."""
    kind, target = parse_environment(spec)

    def make_rollout_fn(setup: RolloutSetup) -> Any:
        if kind == "verifiers":
            from fleetrl.environments.verifiers import VerifiersRollout

            return VerifiersRollout(setup, target, options)
        from fleetrl.environments.openenv import OpenEnvRollout

        return OpenEnvRollout(setup, target, options)

    return make_rollout_fn


def make_rollout_fn(setup: RolloutSetup) -> Any:
    """`[up] rollout = "fleetrl.environments:make_rollout_fn"`: the environment named by `rollout_extras.environment`,
    with `rollout_extras.environment_options` as its options."""
    spec = setup.extras.get("environment")
    if not spec:
        raise ValueError("rollout_extras.environment: name the environment, e.g. 'verifiers:reverse_text'")
    return environment_rollout(str(spec), setup.extras.get("environment_options"))(setup)


def environment_rows(spec: str, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per task of the environment `spec`."""
    kind, target = parse_environment(spec)
    if kind == "verifiers":
        from fleetrl.environments.verifiers import environment_rows as rows

        return rows(target, options)
    from fleetrl.environments.openenv import environment_rows as openenv_rows

    return openenv_rows(target, options)


def record_session(path: str | Path, session: AgentSession, run: RolloutRun) -> None:
    """Append one JSON line with what the session server recorded (`turns`) and what the rollout returned
    (`samples`: tokens, logprobs, loss mask): `rollout_extras.record_path`, for audits and the examples' tests."""
    samples = run.to_samples()
    line = {
        "turns": [asdict(turn) for turn in session.turns],
        "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "loss_mask": s.loss_mask} for s in samples],
        "reward": run.reward,
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
