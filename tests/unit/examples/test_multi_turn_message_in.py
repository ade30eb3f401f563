"""examples/multi_turn_message_in: the retry loop's tokens through `MessageTrajectoryAssembler` (no re-tokenization
drift) and the reward."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from fleetrl import RolloutSetup
from fleetrl.message_trajectory import TITOTokenizer, missing_turn_end
from fleetrl.rollout import rollout_result_samples
from tests.unit.examples.helpers import ScriptedSampler, generated_spans, load_example_module

reward = load_example_module("multi_turn_message_in", "reward")
rollout = load_example_module("multi_turn_message_in", "rollout")

MESSAGES = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 6 * 7?"},
]
ROW = {"messages": MESSAGES, "answer": "42"}
# History-rewriting template in the style of Qwen3's: an assistant turn followed by another message loses its
# <think>...</think> block, so re-rendering the conversation changes tokens the model already saw.
THINK_STRIPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and not loop.last %}"
    "{%- set content = message['content'].split('</think>')[-1] %}"
    "{%- else %}{%- set content = message['content'] %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def im_end(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def turn(tokenizer, text: str) -> list[int]:
    """A reply the model ended itself: its text's tokens and <|im_end|>."""
    return [*enc(tokenizer, text), im_end(tokenizer)]


def run_rollout(tokenizer, replies, row=ROW, **extras):
    sampler = ScriptedSampler(tokenizer, replies)
    setup = RolloutSetup(tokenizer=tokenizer, sampler=sampler, sample_kwargs={"max_tokens": 8}, extras=extras)
    result = asyncio.run(rollout.make_rollout_fn(setup)(row))
    # A RolloutRun whose segments (one per model call) extend each other: one sample.
    (sample,) = rollout_result_samples(result) or (None,)
    return sample, sampler


def test_the_trajectory_is_each_calls_prompt_and_generated_tokens_concatenated(tokenizer):
    replies = [turn(tokenizer, "The answer is 41."), turn(tokenizer, "I do not know"), turn(tokenizer, "42")]
    sample, sampler = run_rollout(tokenizer, replies, max_turns=3)
    prompts, generated = sampler.prompts, sampler.generated
    assert len(prompts) == 3
    # Every call's prompt is the previous call's prompt and generation, verbatim, plus the feedback turn.
    for i in range(2):
        assert prompts[i + 1][: len(prompts[i]) + len(generated[i])] == prompts[i] + generated[i]
    feedback = [prompts[i + 1][len(prompts[i]) + len(generated[i]) :] for i in range(2)]
    expected = prompts[0] + generated[0] + feedback[0] + generated[1] + feedback[1] + generated[2]
    assert sample.tokens == expected == prompts[-1] + generated[-1]
    assert tokenizer.decode(feedback[0]) == (
        "\n<|im_start|>user\nThat is not correct. Check your work and try again; end your reply with the number."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "I could not find a number" in tokenizer.decode(feedback[1])
    # loss_mask is 1 exactly on the generated tokens, which carry the sampler's logprobs; 0 and 0.0 elsewhere.
    starts = [len(p) for p in prompts]
    assert generated_spans(sample.loss_mask) == [(s, s + len(g)) for s, g in zip(starts, generated, strict=True)]
    for call, (s, g) in enumerate(zip(starts, generated, strict=True)):
        assert sample.logprobs[s : s + len(g)] == [-(call + 1) - 0.01 * i for i in range(len(g))]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
    assert sample.versions is None  # as in the cookbook: the controller bounds staleness by the lease's version
    assert sample.reward == pytest.approx(0.25)  # correct on the third turn: 0.5 ** 2
    assert sample.metrics == {"correct": 1.0, "turns": 3.0, "first_try_correct": 0.0}
    assert sample.text == "42"
    # Every call stops at the template's end of turn, whatever the model's generation config says.
    assert sampler.kwargs == [{"max_tokens": 8, "stop_token_ids": [im_end(tokenizer)]}] * 3
    sample.validate()


def test_appended_turns_are_the_tokens_the_chat_template_writes(tokenizer):
    texts = ["It is 41.", "Sorry, 42"]
    sample, _ = run_rollout(tokenizer, [turn(tokenizer, t) for t in texts], max_turns=3)
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": texts[0]},
        reward.feedback_message(texts[0]),
        {"role": "assistant", "content": texts[1]},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    # The trajectory stops at the model's <|im_end|>; the template's turn ends with "<|im_end|>\n".
    turn_end = TITOTokenizer(tokenizer).turn_end_tokens()
    assert sample.tokens + missing_turn_end(sample.tokens, turn_end) == enc(tokenizer, rendered)


def test_generated_tokens_are_kept_verbatim_where_re_tokenizing_would_drift(tokenizer):
    # The model spelled " the" as four tokens; BPE would encode the decoded text as one. Re-rendering the
    # conversation would train on a token sequence the policy never generated.
    spelled = [tokenizer.convert_tokens_to_ids(t) for t in ["Ġ", "t", "h", "e"]]
    first = spelled + turn(tokenizer, " answer is 41")
    assert enc(tokenizer, tokenizer.decode(first, skip_special_tokens=True)) != first[:-1]
    sample, sampler = run_rollout(tokenizer, [first, turn(tokenizer, "42")], max_turns=2)
    start = len(sampler.prompts[0])
    assert sample.tokens[start : start + len(first)] == first
    assert sampler.prompts[1][start : start + len(first)] == first  # and the model saw them as it wrote them


def test_history_rewriting_templates_do_not_change_what_the_model_saw(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    first_text = "<think>6 times 7 is 41</think>41"
    sample, sampler = run_rollout(tokenizer, [turn(tokenizer, first_text), turn(tokenizer, "42")], max_turns=2)
    prompts, generated = sampler.prompts, sampler.generated
    assert sample.tokens == prompts[1] + generated[1]
    assert prompts[1][: len(prompts[0]) + len(generated[0])] == prompts[0] + generated[0]
    assert "<think>6 times 7 is 41</think>41" in tokenizer.decode(sample.tokens)
    # Re-rendering the same conversation would have dropped the thinking the model actually conditioned on.
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": first_text},
        reward.feedback_message(first_text),
        {"role": "assistant", "content": "42"},
    ]
    assert "<think>" not in tokenizer.apply_chat_template(conversation, tokenize=False)


def test_a_reply_cut_by_max_tokens_gets_the_whole_turn_end(tokenizer):
    truncated = enc(tokenizer, "The answer might be")  # no <|im_end|>: finish_reason "length"
    sample, sampler = run_rollout(tokenizer, [truncated, turn(tokenizer, "42")], max_turns=2)
    after = sampler.prompts[1][len(sampler.prompts[0]) + len(truncated) :]
    assert after[:2] == TITOTokenizer(tokenizer).turn_end_tokens() == [im_end(tokenizer), enc(tokenizer, "\n")[0]]
    assert sample.reward == 0.5


def test_a_right_first_answer_ends_the_rollout(tokenizer):
    sample, sampler = run_rollout(tokenizer, [turn(tokenizer, "6 * 7 = 42")], max_turns=3)
    assert len(sampler.prompts) == 1
    assert sample.tokens == sampler.prompts[0] + sampler.generated[0]
    assert sample.reward == 1.0 and sample.metrics["first_try_correct"] == 1.0


def test_stops_before_a_turn_that_would_not_fit_max_seq_len(tokenizer):
    replies = [turn(tokenizer, "41")] * 3
    prompt_len = len(TITOTokenizer(tokenizer).render_initial_prompt(MESSAGES))
    sample, sampler = run_rollout(tokenizer, replies, max_turns=3, max_seq_len=prompt_len + 40)
    assert len(sampler.prompts) == 1
    assert sample.reward == 0.0 and sample.metrics["turns"] == 1.0
    assert len(sample.tokens) <= prompt_len + 40


def test_a_tokenizer_without_chat_template_fails_at_setup(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        rollout.make_rollout_fn(RolloutSetup(tokenizer=tokenizer, sampler=ScriptedSampler(tokenizer, [])))


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("42", 42), ("6 * 7 = 42.", 42), ("It's -3", -3), ("about 1,234 total", 1234), ("no idea", None), ("", None)],
)
def test_parse_answer_takes_the_last_integer(reply, expected):
    assert reward.parse_answer(reply) == expected


def test_reward_discounts_retries():
    assert reward.is_correct("so 42", "42") and not reward.is_correct("41", 42)
    assert [reward.compute_reward(True, t) for t in (1, 2, 3)] == [1.0, 0.5, 0.25]
    assert reward.compute_reward(False, 1) == 0.0
    assert reward.compute_reward(True, 2, retry_discount=1.0) == 1.0
    with pytest.raises(ValueError, match="turns_used"):
        reward.compute_reward(True, 0)
    with pytest.raises(ValueError, match="retry_discount"):
        reward.compute_reward(True, 1, retry_discount=1.5)


def test_feedback_says_what_was_wrong():
    assert reward.feedback_message("41")["content"].startswith("That is not correct")
    assert reward.feedback_message("hmm") == {
        "role": "user",
        "content": "I could not find a number in your answer. Try again and end your reply with the number.",
    }
