"""Rollout functions the `fleetrl up` integration tests run in real gateways (imported by module path)."""

from __future__ import annotations

import asyncio

from fleetrl import RolloutSample, RolloutSetup


def _sample(completion, reward: float) -> RolloutSample:
    n_prompt, generated = completion.prompt_len, len(completion.inference_logprobs)
    first = completion.versions[0] if completion.versions else 0
    return RolloutSample(
        tokens=completion.full_tokens,
        logprobs=[0.0] * n_prompt + completion.inference_logprobs,
        loss_mask=[0] * n_prompt + [1] * generated,
        reward=reward,
        finish_reason=completion.finish_reason,
        text=completion.text,
        versions=[first] * n_prompt + completion.versions,
        metrics={"even_frac": reward},
    )


def make_rollout_fn(setup: RolloutSetup):
    """Reward: the fraction of generated tokens with an even id (a tiny model can move it)."""

    async def rollout_fn(row: dict) -> RolloutSample | None:
        prompt = setup.tokenizer.encode(row["prompt"])
        (completion,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        generated = completion.completion_tokens
        reward = sum(1 for t in generated if t % 2 == 0) / max(len(generated), 1)
        return _sample(completion, reward)

    return rollout_fn


def make_slow_rollout_fn(setup: RolloutSetup):
    """The same with a slow tool call between sampling and scoring."""
    inner = make_rollout_fn(setup)

    async def rollout_fn(row: dict) -> RolloutSample | None:
        sample = await inner(row)
        await asyncio.sleep(float(setup.extras.get("tool_latency_s", 0.2)))
        return sample

    return rollout_fn


def make_faulty_rollout_fn(setup: RolloutSetup):
    """Every 7th call raises, every 5th returns None, every 6th returns a malformed sample; the rest are fine."""
    inner = make_rollout_fn(setup)
    calls = {"n": 0}

    async def rollout_fn(row: dict) -> RolloutSample | None:
        calls["n"] += 1
        n = calls["n"]
        if n % 7 == 0:
            raise ZeroDivisionError("the user's reward code divided by zero")
        if n % 5 == 0:
            return None
        sample = await inner(row)
        if n % 6 == 0:
            sample.loss_mask = [2] * len(sample.tokens)  # breaks the contract: mask values must be 0 or 1
        return sample

    return rollout_fn


def make_broken_rollout_fn(setup: RolloutSetup):
    """Always raises: the gateway's circuit breaker must stop the run with a clear message."""

    async def rollout_fn(row: dict) -> RolloutSample | None:
        raise KeyError(f"row has no field 'question': {sorted(row)}")

    return rollout_fn


async def broken_evaluate(setup: RolloutSetup, rows: list[dict]) -> dict[str, float]:
    """An evaluation hook that samples once, then fails (fleetrl eval must say so and exit 1)."""
    await setup.sampler.sample_with_prompt_tokens(setup.tokenizer.encode(rows[0]["prompt"]), n=1, max_tokens=2)
    raise RuntimeError("the grader is down")
