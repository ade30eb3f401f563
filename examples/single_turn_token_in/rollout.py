"""Single-turn, token-in/token-out rollout: the row carries its prompt as token ids; one sampler call; scored.

Rows: {"prompt_tokens": [int, ...], "answer": "42"}. The reward is 1 when the first integer of the completion
equals the answer, else 0. Loaded by the gateways as `rollout.py:make_rollout_fn` (see run.toml / train.py).
Written in the structure of the cookbook's single-turn token-in rollout: `build_deployment_sampler(setup)`, one
`sample_with_prompt_tokens` call, and a `RolloutRun` of one `RolloutSample` segment that carries the reward.
"""

from __future__ import annotations

import re

from fleetrl import RolloutRun, RolloutSample, RolloutSetup, build_deployment_sampler
from fleetrl.rollout import RolloutFn

_INT = re.compile(r"-?\d+")


def score(completion_text: str, answer: str) -> float:
    """1.0 when the first integer in `completion_text` equals `answer` (an integer string), else 0.0."""
    match = _INT.search(completion_text)
    return float(match is not None and int(match.group()) == int(answer))


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    sampler = build_deployment_sampler(setup)
    sample_kwargs = dict(setup.sample_kwargs)

    async def rollout_fn(sample_prompt: dict) -> RolloutRun | None:
        prompt_token_ids = list(sample_prompt.get("prompt_tokens") or [])
        if not prompt_token_ids:
            return None
        # Token in, token out: the prompt goes to the engine as ids; nothing is re-tokenized on the way back.
        completions = await sampler.sample_with_prompt_tokens(prompt_token_ids, n=1, **sample_kwargs)
        if not completions:
            return None
        completion = completions[0]
        prompt_len = int(completion.prompt_len)
        tokens = list(completion.full_tokens)
        output_logprobs = list(completion.sampling_logprobs)
        if len(tokens) == prompt_len or len(output_logprobs) != len(tokens) - prompt_len:
            return None  # nothing to train on; the gateway drops and counts it
        reward = score(completion.text, str(sample_prompt["answer"]))
        sample = RolloutSample(
            tokens=tokens,
            logprobs=[0.0] * prompt_len + output_logprobs,  # prompt positions are never trained (mask 0)
            loss_mask=[0] * prompt_len + [1] * len(output_logprobs),
            reward=reward,
            finish_reason=completion.finish_reason,
            text=completion.text,
            # fleetrl's additions: the version of every token (the off-policy gate's exact per-token figure) and
            # the figures reported per step as env/all/<name>.
            versions=[completion.versions[0]] * prompt_len + list(completion.versions),
            metrics={"correct": reward, "truncated": float(completion.finish_reason == "length")},
        )
        return RolloutRun(segments=[sample])

    return rollout_fn
