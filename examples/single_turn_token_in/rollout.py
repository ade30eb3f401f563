"""Single-turn, token-in/token-out rollout: the row carries its prompt as token ids; one sampler call; scored.

Rows: {"prompt_tokens": [int, ...], "answer": "42"}. The reward is 1 when the first integer of the completion
equals the answer, else 0. Loaded by the gateways as `rollout.py:make_rollout_fn` (see run.toml / train.py).
Written against the current cookbook contract: `build_deployment_sampler(setup)`, `sampling_logprobs`, and a
`RolloutRun` of one segment returned.
"""

from __future__ import annotations

import re

from fleetrl import RolloutRun, RolloutSegment, RolloutSetup, build_deployment_sampler
from fleetrl.rollout import RolloutFn

_INT = re.compile(r"-?\d+")


def score(completion_text: str, answer: str) -> float:
    """1.0 when the first integer in `completion_text` equals `answer` (an integer string), else 0.0."""
    match = _INT.search(completion_text)
    return float(match is not None and int(match.group()) == int(answer))


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    sampler = build_deployment_sampler(setup)

    async def rollout_fn(row: dict) -> RolloutRun | None:
        prompt_tokens = row["prompt_tokens"]
        # Token in, token out: the prompt goes to the engine as ids; nothing is re-tokenized on the way back.
        (completion,) = await sampler.sample_with_prompt_tokens(prompt_tokens, n=1, **setup.sample_kwargs)
        n_prompt, n_generated = completion.prompt_len, len(completion.sampling_logprobs)
        if n_generated == 0:
            return None  # nothing to train on; the gateway drops and counts it
        reward = score(completion.text, str(row["answer"]))
        # Prompt positions are never trained (mask 0, logprob 0.0); the version list covers every token so the
        # off-policy gate sees the version that generated each trainable token.
        segment = RolloutSegment(
            tokens=completion.full_tokens,
            logprobs=[0.0] * n_prompt + completion.sampling_logprobs,
            loss_mask=[0] * n_prompt + [1] * n_generated,
            versions=[completion.versions[0]] * n_prompt + completion.versions,
        )
        return RolloutRun(
            segments=[segment],
            reward=reward,
            finish_reason=completion.finish_reason,
            text=completion.text,
            metrics={"correct": reward, "truncated": float(completion.finish_reason == "length")},
        )

    return rollout_fn
