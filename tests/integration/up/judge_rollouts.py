"""A rollout that scores through the judge pool (setup.judge_sampler), for the tests that start one outside
`fleetrl up`'s example (the chart's pods, `fleetrl eval`): imported by module path."""

from __future__ import annotations

from fleetrl import RolloutSample, RolloutSetup


def make_judged_rollout_fn(setup: RolloutSetup):
    """Reward: the fraction of even token ids in the judge's greedy reply to the policy's completion; raises without
    a judge pool, so a sample carrying `judged` means the judge answered it."""
    if setup.judge_sampler is None:
        raise RuntimeError("this rollout needs a judge pool (setup.judge_sampler)")
    judge = setup.judge_sampler

    async def rollout_fn(row: dict) -> RolloutSample | None:
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        (verdict,) = await judge.sample_with_prompt_tokens(c.full_tokens, n=1, max_tokens=4, temperature=0.0)
        said = verdict.completion_tokens
        reward = sum(1 for t in said if t % 2 == 0) / max(len(said), 1)
        n_prompt, generated = c.prompt_len, len(c.inference_logprobs)
        first = c.versions[0] if c.versions else 0
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * n_prompt + c.inference_logprobs,
            loss_mask=[0] * n_prompt + [1] * generated,
            reward=reward,
            finish_reason=c.finish_reason,
            text=c.text,
            versions=[first] * n_prompt + c.versions,
            metrics={"judged": 1.0, "judge_tokens": float(len(said))},
        )

    return rollout_fn
