"""Rollout and evaluation functions of the arithmetic task (run by the gateways under `fleetrl up`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from fleetrl import RolloutSample, RolloutSetup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arithmetic_task import score


def make_rollout_fn(setup: RolloutSetup):
    """One sampler call per invocation: the prompt's tokens in, the completion's tokens and logprobs out."""

    async def rollout_fn(row: dict) -> RolloutSample | None:
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        reward = score(c.text, row["answer"], finished=c.finish_reason == "stop")
        generated = len(c.inference_logprobs)
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * generated,
            reward=reward,
            finish_reason=c.finish_reason,
            text=c.text,
            versions=[c.versions[0] if c.versions else 0] * c.prompt_len + c.versions,
            metrics={"correct": reward},
        )

    return rollout_fn


async def evaluate(setup: RolloutSetup, rows: list[dict]) -> dict[str, float]:
    """Held-out accuracy: greedy (temperature 0) and one sample at the training temperature per problem."""

    async def one(row: dict, temperature: float) -> float:
        prompt = setup.tokenizer.encode(row["prompt"])
        kwargs = {**setup.sample_kwargs, "temperature": temperature}
        (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **kwargs)
        return score(c.text, row["answer"], finished=c.finish_reason == "stop")

    greedy = await asyncio.gather(*(one(r, 0.0) for r in rows))
    sampled = await asyncio.gather(*(one(r, setup.sample_kwargs.get("temperature", 1.0)) for r in rows))
    return {"accuracy": sum(greedy) / len(rows), "sampled_accuracy": sum(sampled) / len(rows)}
