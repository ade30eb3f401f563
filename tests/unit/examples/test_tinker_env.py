"""examples/tinker_env: the Tinker env run through fleetrl.tinker with a scripted sampler (no services)."""

from __future__ import annotations

import asyncio

from fleetrl.tinker import dataset_rows, run_group
from tests.unit.examples.helpers import ScriptedSampler, load_example_module

env = load_example_module("tinker_env", "env")


def test_a_wrong_answer_retries_on_an_extended_observation_and_the_group_reward_sees_all(tokenizer):
    builder = env.AdditionGroupBuilder(tokenizer, 2, 3, group_size=2)
    right, wrong = tokenizer.encode(" 5", add_special_tokens=False), tokenizer.encode(" 17", add_special_tokens=False)
    # The first call made answers 17 (member 0: envs start in order), every other call 5.
    calls: list[list[int]] = []

    def reply(prompt: list[int]) -> list[int]:
        calls.append(prompt)
        return wrong if len(calls) == 1 else right

    sampler = ScriptedSampler(tokenizer, reply)
    retried, at_once = asyncio.run(run_group(builder, sampler, {"max_tokens": 8}, 2))
    (one,) = at_once.to_samples()
    (two,) = retried.to_samples()  # the retry extends the first turn: one sample, two assistant turns
    assert one.reward == 1.0 + 0.1 and one.metrics["env/addition/correct"] == 1.0
    assert two.reward == 0.5 + 0.1 and two.metrics["turns"] == 2.0  # both final answers are " 5": both shortest
    assert two.tokens[: len(calls[0])] == calls[0] and sum(two.loss_mask) == len(wrong) + len(right)
    assert all(kw == {"max_tokens": 8, "stop": ["\n"]} for kw in sampler.kwargs)


def test_the_dataset_is_seeded_and_gives_one_row_per_builder():
    a, b = env.AdditionDataset(None, 3, 2, 4, seed=1), env.AdditionDataset(None, 3, 2, 4, seed=1)
    assert a.batches == b.batches and len(dataset_rows(a)) == 6
