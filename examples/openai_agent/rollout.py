"""Training the OpenAI-SDK agent of agent.py as it is: each sample opens an agent session (a per-sample OpenAI
endpoint that fleetrl records), runs the unmodified agent against it and returns the session as a `RolloutRun`.

    fleetrl up examples/openai_agent/run.toml

The trained tokens are exactly what the replica generated, with its logprobs and policy versions (nothing is
re-tokenised); where the chat template re-renders the history differently from what the model wrote, the trajectory
splits into segments (`env/all/session_splits`). With `rollout_extras.record_path` set, every sample appends one
JSON line with what the server recorded and what the rollout returned, for tests/integration/examples.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Any

import openai
from agent import solve  # this example's agent, beside this file (fleetrl loads the rollout file's folder too)

from fleetrl import RolloutRun, RolloutSetup


def score(answer: str, expected: int) -> float:
    """1 for the right number, else the share of digits in the answer (a little signal for an untrained model)."""
    numbers = re.findall(r"-?\d+", answer)
    if numbers and int(numbers[-1]) == expected:
        return 1.0
    return 0.5 * sum(ch.isdigit() for ch in answer) / max(len(answer), 1)


def make_rollout_fn(setup: RolloutSetup):  # type: ignore[no-untyped-def]
    record_path = setup.extras.get("record_path")
    max_turns = int(setup.extras.get("max_turns", 3))
    exact_history = bool(setup.extras.get("exact_history", False))

    async def rollout_fn(row: dict[str, Any]) -> RolloutRun:
        session = await setup.open_session(exact_history=exact_history)
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            answer = await solve(client, session.model, row["question"], max_turns=max_turns)
        run = session.to_rollout_run(reward=score(answer, int(row["answer"])))
        if record_path:
            samples = run.to_samples()
            line = {
                "turns": [asdict(turn) for turn in session.turns],
                "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "loss_mask": s.loss_mask} for s in samples],
            }
            with open(record_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return run

    return rollout_fn
