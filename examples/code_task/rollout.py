"""A tiny code-writing task: the model writes a Python function, and the reward is the share of the problem's unit
tests that pass when the program runs in fleetrl's sandbox (code_reward.py).

    python -m fleetrl.tiny_model runs/tiny_model
    fleetrl up examples/code_task/run.toml

Each row is {"id", "prompt", "tests"} (problems.jsonl); the prompt goes in as a chat message, the reply is
trained token for token (its sampler logprobs and versions), and its first fenced code block (or the whole reply)
is the program. `rollout_extras` sets the sandbox's limits (`timeout_s`, `cpu_s`, `memory_mb`).
"""

from __future__ import annotations

from typing import Any

from code_reward import extract_code, score_program  # beside this file (fleetrl loads the rollout file's folder too)

from fleetrl import RolloutSample, RolloutSetup

SYSTEM = "Answer with only a Python code block that defines the function."


def make_rollout_fn(setup: RolloutSetup):  # type: ignore[no-untyped-def]
    limits = {k: setup.extras[k] for k in ("timeout_s", "cpu_s", "memory_mb") if k in setup.extras}

    async def rollout_fn(row: dict[str, Any]) -> RolloutSample:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
        (c,) = await setup.sampler.sample_with_tokens(messages=messages, n=1, **setup.sample_kwargs)
        reward, metrics = await score_program(extract_code(c.text), list(row["tests"]), **limits)
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * len(c.inference_logprobs),
            reward=reward,
            finish_reason=c.finish_reason,
            versions=[c.versions[0] if c.versions else 0] * c.prompt_len + list(c.versions),
            metrics={"solved": float(reward == 1.0), **metrics},
        )

    return rollout_fn
