"""The example rollout function of docker-compose.yml (FLEETRL_ROLLOUT=rollout:make_rollout_fn).

Reward 1 when the completion starts with the row's answer. The config folder is on the containers' PYTHONPATH,
so put your own module next to this one and point FLEETRL_ROLLOUT at it.
"""

from __future__ import annotations

from fleetrl import RolloutSample, RolloutSetup


def make_rollout_fn(setup: RolloutSetup):
    async def rollout_fn(row: dict) -> RolloutSample | None:
        prompt = setup.tokenizer.encode(row["prompt"])
        (out,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        text = setup.tokenizer.decode(out.completion_tokens).strip()
        reward = float(text.split(" ")[0] == row["answer"]) if text else 0.0
        return RolloutSample(
            tokens=out.full_tokens,
            logprobs=[0.0] * out.prompt_len + out.inference_logprobs,
            loss_mask=[0] * out.prompt_len + [1] * len(out.inference_logprobs),
            reward=reward,
            finish_reason=out.finish_reason,
            versions=[out.versions[0] if out.versions else 0] * out.prompt_len + out.versions,
            metrics={"correct": reward},
        )

    return rollout_fn
