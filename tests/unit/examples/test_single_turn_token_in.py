"""examples/single_turn_token_in: the score, and one token-in/token-out call per rollout."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl import RolloutSetup
from fleetrl.rollout import rollout_result_samples
from tests.unit.examples.helpers import ScriptedSampler, load_example_module

rollout = load_example_module("single_turn_token_in", "rollout")
train = load_example_module("single_turn_token_in", "train")


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [(" 42", "42", 1.0), ("42 and 7", "42", 1.0), ("7 then 42", "42", 0.0), ("-5", "-5", 1.0), ("none", "3", 0.0)],
)
def test_score_is_the_first_integer_matching(text, answer, expected):
    assert rollout.score(text, answer) == expected


def test_one_token_in_token_out_call_scored(tokenizer):
    row = train.make_rows(tokenizer, 1, seed=0)[0]
    answer_tokens = tokenizer.encode(" " + row["answer"], add_special_tokens=False)
    sampler = ScriptedSampler(tokenizer, [[*answer_tokens, tokenizer.eos_token_id]])
    kwargs = {"max_tokens": 8, "temperature": 1.0}
    setup = RolloutSetup(tokenizer=tokenizer, sampler=sampler, sample_kwargs=kwargs)
    (sample,) = rollout_result_samples(asyncio.run(rollout.make_rollout_fn(setup)(row)))  # a RolloutRun of one
    assert sampler.prompts == [row["prompt_tokens"]] and sampler.kwargs == [kwargs]
    n = len(row["prompt_tokens"])
    assert sample.tokens == row["prompt_tokens"] + sampler.generated[0]
    assert sample.loss_mask == [0] * n + [1] * len(sampler.generated[0])
    generated_logprobs = [-1 - 0.01 * i for i in range(len(sampler.generated[0]))]
    assert sample.logprobs == [0.0] * n + generated_logprobs
    assert sample.reward == 1.0 and sample.finish_reason == "stop"
    sample.validate()


def test_rows_are_the_chat_template_as_tokens(tokenizer):
    rows = train.make_rows(tokenizer, 3, seed=1)
    assert rows == train.make_rows(tokenizer, 3, seed=1)  # seeded
    text = tokenizer.decode(rows[0]["prompt_tokens"])
    assert text.startswith("<|im_start|>user\nWhat is ") and text.endswith("<|im_start|>assistant\n")
    a, b = text.split("What is ")[1].split("?")[0].split(" + ")
    assert int(a) + int(b) == int(rows[0]["answer"])


def test_bad_rows_file_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt_tokens": [1, 2], "answer": "3"}\n{"prompt": "x", "answer": "3"}\n')
    with pytest.raises(SystemExit, match=r"rows.jsonl:2: each row needs 'prompt_tokens'"):
        train.read_rows(str(path))
