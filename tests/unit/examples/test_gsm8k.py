"""examples/gsm8k: the reward 1[answer correct] + 0.1 * (1[format correct] - 1) and the rollout on sample rows."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from fleetrl import RolloutSetup
from tests.unit.examples.helpers import EXAMPLES, ScriptedSampler, load_example_module

rollout = load_example_module("gsm8k", "rollout")
train = load_example_module("gsm8k", "train")
ANSWER = "She has 3 * 12 = <<3*12=36>>36 pencils.\n#### 36"


@pytest.mark.parametrize(
    ("completion", "reward", "correct", "format_ok"),
    [
        ("3 * 12 = 36.\n#### 36", 1.0, True, True),
        ("#### 35\nno wait\n#### 36", 1.0, True, True),  # the last '####' counts
        ("####36", 1.0, True, True),
        ("#### 36.00", 1.0, True, True),
        ("3 * 12 = 36, so 36", 0.9, True, False),  # right number, no '####'
        ("#### 35", 0.0, False, True),
        ("36 pencils; #### 35", 0.0, False, True),  # a formatted answer wins over other numbers
        ("no idea", -0.1, False, False),
        ("", -0.1, False, False),
        ("#### thirty-six", -0.1, False, False),
    ],
)
def test_reward(completion, reward, correct, format_ok):
    got = rollout.gsm8k_reward(completion, ANSWER)
    assert got[0] == pytest.approx(reward) and got[1:] == (correct, format_ok)


def test_numbers_with_commas_dollars_and_signs():
    assert rollout.gsm8k_reward("#### $1,200", "... #### 1200")[1]
    assert rollout.gsm8k_reward("#### 1200", "... #### 1,200")[1]
    assert rollout.gsm8k_reward("#### -5", "... #### -5")[1]
    assert not rollout.gsm8k_reward("#### 5", "... #### -5")[1]
    assert rollout.gsm8k_reward("so it is 2.5 hours", "... #### 2.5")[:2] == (0.9, True)


def test_reference_answer_needs_the_hashes():
    assert rollout.reference_answer("a\nb #### 1,000 ") == "1,000"
    with pytest.raises(ValueError, match="no '#### <answer>'"):
        rollout.reference_answer("the answer is 4")


def test_sample_rows_are_gsm8k_shaped_and_their_own_answers_score_1():
    path = EXAMPLES / "gsm8k" / "sample.jsonl"
    assert train.check_rows(path) == 8
    for line in path.read_text().splitlines():
        row = json.loads(line)
        # The reference solution itself is a correct, formatted completion.
        assert rollout.gsm8k_reward(row["answer"], row["answer"]) == (1.0, True, True)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"question": "q", "answer": "4"}\n', "must end with '#### <number>'"),
        ('{"answer": "#### 4"}\n', "needs a 'question' string"),
        ("not json\n", "not valid JSON"),
        ("\n", "no rows"),
    ],
)
def test_check_rows_names_the_problem(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        train.check_rows(path)


def run_rollout(tokenizer, reply_text: str):
    reply = [*tokenizer.encode(reply_text, add_special_tokens=False), tokenizer.eos_token_id]
    sampler = ScriptedSampler(tokenizer, [reply])
    setup = RolloutSetup(tokenizer=tokenizer, sampler=sampler, sample_kwargs={"max_tokens": 64})
    sample = asyncio.run(rollout.make_rollout_fn(setup)({"question": "Mia has 3 packs of 12.", "answer": ANSWER}))
    return sample, sampler


def test_rollout_through_the_chat_template(tokenizer):
    sample, sampler = run_rollout(tokenizer, "3 * 12 = 36\n#### 36")
    prompt = tokenizer.decode(sampler.prompts[0])
    assert prompt.startswith("<|im_start|>user\nMia has 3 packs of 12.\n\nSolve the problem step by step.")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert sample.reward == 1.0 and sample.metrics == {"correct": 1.0, "format_ok": 1.0, "truncated": 0.0}
    n = len(sampler.prompts[0])
    assert sample.loss_mask == [0] * n + [1] * len(sampler.generated[0])
    sample.validate()


def test_rollout_with_a_base_model_without_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    sample, sampler = run_rollout(tokenizer, "36")
    assert tokenizer.decode(sampler.prompts[0]).startswith("Question: Mia has 3 packs of 12.\nSolve")
    assert sample.reward == pytest.approx(0.9)
