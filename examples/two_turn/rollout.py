"""The two-turn task (two_turn_task.py) as a rollout for `fleetrl up`: two sampler calls of one token each, the
second on the first's tokens plus the environment's observation, returned as a RolloutRun with per-turn rewards
(`rollout_extras = {per_turn = false}`: one final reward instead). Rows are {"prompt": p}, p in [0, K); the task's
tokens are the model's token ids 0 .. K + 1, whatever text they stand for."""

from __future__ import annotations

import sys
from pathlib import Path

from fleetrl import RolloutSetup
from fleetrl.rollout import RolloutRun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_turn_task import episode_run, observe


def make_rollout_fn(setup: RolloutSetup):
    per_turn = bool(setup.extras.get("per_turn", True))
    kwargs = {**setup.sample_kwargs, "max_tokens": 1}

    async def rollout_fn(row: dict) -> RolloutRun | None:
        prompt = int(row["prompt"])
        (first,) = await setup.sampler.sample_with_prompt_tokens([prompt], n=1, **kwargs)
        if not first.inference_logprobs:  # stopped before a token (an end-of-text not kept): dropped, counted
            return None
        answer1 = first.full_tokens[-1]
        (second,) = await setup.sampler.sample_with_prompt_tokens(
            [prompt, answer1, observe(prompt, answer1)], n=1, **kwargs
        )
        if not second.inference_logprobs:
            return None
        return episode_run(
            prompt,
            answer1,
            first.inference_logprobs[-1],
            second.full_tokens[-1],
            second.inference_logprobs[-1],
            per_turn=per_turn,
            version=min([*first.versions, *second.versions], default=0),
        )

    return rollout_fn
