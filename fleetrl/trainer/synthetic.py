"""Synthetic rollout groups for tests, benchmarks and trying the trainer without any other service.

    groups = synthetic_groups(num_groups=4, group_size=4, vocab_size=500, seed=0, model=model)
    write_groups_jsonl("groups.jsonl", groups)   # then: fleetrl serve trainer --standalone groups.jsonl

Tokens are random (seeded); each sample is a prompt (mask 0) followed by a completion (mask 1), of
lengths drawn from the given ranges. With `model`, the rollout logprobs are that model's own logprobs
of the completion tokens (so the importance ratios start at 1, as on-policy data would); without one they
are a constant. Rewards are 0/1, never uniform within a group, so every group carries a signal.
"""

from __future__ import annotations

import random
from typing import Any

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup


def synthetic_groups(
    *,
    num_groups: int,
    group_size: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (4, 8),
    completion_len: tuple[int, int] = (4, 12),
    seed: int = 0,
    model: Any = None,
    temperature: float = 1.0,
    first_row_id: int = 0,
    submit_version: int = 0,
) -> list[RolloutGroup]:
    """`num_groups` groups of `group_size` samples; see the module docstring."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        for reward in rewards:
            n_prompt = rng.randint(*prompt_len)
            n_completion = rng.randint(*completion_len)
            tokens = [rng.randrange(vocab_size) for _ in range(n_prompt + n_completion)]
            mask = [0] * n_prompt + [1] * n_completion
            samples.append(
                RolloutSample(
                    tokens=tokens,
                    logprobs=[-1.0 if m else 0.0 for m in mask],
                    loss_mask=mask,
                    reward=reward,
                    versions=[submit_version] * len(tokens),
                    metrics={"correct": reward},
                )
            )
        groups.append(RolloutGroup(first_row_id + g, submit_version, samples))
    if model is not None:
        _fill_model_logprobs(groups, model, temperature)
    return groups


def _fill_model_logprobs(groups: list[RolloutGroup], model: Any, temperature: float) -> None:
    from fleetrl.trainer.model import sequence_logprobs

    samples = [s for g in groups for s in g.samples]
    logprobs = sequence_logprobs(
        model,
        [s.tokens for s in samples],
        temperature=temperature,
        device=next(model.parameters()).device,
    )
    for sample, lps in zip(samples, logprobs, strict=True):
        # Target-aligned lps[i] is the logprob of tokens[i + 1]; the sample's own list is per token.
        sample.logprobs = [0.0] + [lp if m else 0.0 for lp, m in zip(lps, sample.loss_mask[1:], strict=True)]
