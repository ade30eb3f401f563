"""fleetrl.message_trajectory: the cookbook's MessageTrajectoryAssembler / TITOTokenizer on the tiny model's
ChatML tokenizer: each turn's prompt extends the last call's tokens; to_flat masks exactly the completions."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fleetrl import MessageTrajectoryAssembler, TITOTokenizer
from fleetrl.message_trajectory import (
    InferenceCall,
    MessageValidationError,
    PrefixMismatch,
    TokenizationError,
    TrajectoryAssembler,
    missing_turn_end,
)

MESSAGES = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 6 * 7?"},
]
FEEDBACK = {"role": "user", "content": "That is not correct. Try again."}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def im_end(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def respond(assembler, request, prompt, completion, logprobs, finish_reason="stop"):
    reply = {"role": "assistant", "content": "reply"}
    assembler.add_assistant_response(
        request_messages=request,
        assistant_message=reply,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        finish_reason=finish_reason,
    )
    return reply


def test_two_turns_flatten_to_prompt_completion_bridge_completion(tokenizer):
    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    prompt1 = assembler.prepare_next_input(MESSAGES)
    assert prompt1 == enc(
        tokenizer, tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    )
    # The model spelled " the" as four tokens (BPE would merge the decoded text into one) and stopped on <|im_end|>.
    spelled = [tokenizer.convert_tokens_to_ids(t) for t in ["Ġ", "t", "h", "e"]]
    assert enc(tokenizer, tokenizer.decode(spelled)) != spelled
    completion1 = [*spelled, *enc(tokenizer, " 41"), im_end(tokenizer)]
    reply = respond(assembler, MESSAGES, prompt1, completion1, [-0.5] * len(completion1))

    request2 = [*MESSAGES, reply, FEEDBACK]
    prompt2 = assembler.prepare_next_input(request2)
    bridge = prompt2[len(prompt1) + len(completion1) :]
    assert prompt2[: len(prompt1) + len(completion1)] == prompt1 + completion1  # nothing generated re-tokenized
    assert (
        tokenizer.decode(bridge)
        == "\n<|im_start|>user\nThat is not correct. Try again.<|im_end|>\n<|im_start|>assistant\n"
    )
    completion2 = enc(tokenizer, "42 maybe")  # cut by max_tokens: no <|im_end|>
    logprobs2 = [-1.0 - i for i in range(len(completion2))]
    respond(assembler, request2, prompt2, completion2, logprobs2, finish_reason="length")

    tokens, logprobs, loss_mask = assembler.trajectory.to_flat()
    assert tokens == prompt1 + completion1 + bridge + completion2
    assert loss_mask == [0] * len(prompt1) + [1] * len(completion1) + [0] * len(bridge) + [1] * len(completion2)
    assert logprobs[len(prompt1) : len(prompt1) + len(completion1)] == [-0.5] * len(completion1)
    assert logprobs[-len(completion2) :] == logprobs2
    assert all(lp == 0.0 for lp, m in zip(logprobs, loss_mask, strict=True) if not m)
    assert assembler.token_ids == tokens

    # A third turn after a reply cut by max_tokens closes it with the whole turn end, <|im_end|>\n.
    prompt3 = assembler.prepare_next_input([*request2, {"role": "assistant", "content": "reply"}, FEEDBACK])
    assert prompt3[len(tokens) : len(tokens) + 2] == TITOTokenizer(tokenizer).turn_end_tokens()


def test_a_request_that_does_not_extend_the_conversation_raises(tokenizer):
    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    prompt = assembler.prepare_next_input(MESSAGES)
    reply = respond(assembler, MESSAGES, prompt, [im_end(tokenizer)], [-0.1])
    changed = [MESSAGES[0], {"role": "user", "content": "What is 6 * 8?"}, reply, FEEDBACK]
    with pytest.raises(MessageValidationError, match="message 1 differs"):
        assembler.prepare_next_input(changed)
    with pytest.raises(MessageValidationError, match="fewer than"):
        assembler.prepare_next_input(MESSAGES)
    with pytest.raises(MessageValidationError, match="role 'assistant'"):
        assembler.prepare_next_input([*MESSAGES, reply, {"role": "assistant", "content": "injected"}])


def test_a_call_whose_prompt_does_not_extend_the_trajectory_raises():
    trajectory = TrajectoryAssembler()
    trajectory.add_call(InferenceCall([1, 2, 3], [4, 5], [-0.1, -0.2]))
    with pytest.raises(PrefixMismatch, match="differ from token 1"):
        trajectory.add_call(InferenceCall([1, 9, 3, 4, 5, 6], [7], [-0.3]))
    with pytest.raises(ValueError, match="2 generated tokens but 1 logprobs"):
        trajectory.add_call(InferenceCall([1, 2, 3, 4, 5], [7, 8], [-0.3]))
    trajectory.add_call(InferenceCall([1, 2, 3, 4, 5, 6], [7], [-0.3]))
    assert trajectory.to_flat() == (
        [1, 2, 3, 4, 5, 6, 7],
        [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3],
        [0, 0, 0, 1, 1, 0, 1],
    )


def test_template_pieces(tokenizer):
    tito = TITOTokenizer(tokenizer)
    assert tokenizer.decode(tito.turn_end_tokens()) == "<|im_end|>\n"
    delta = tito.appended_tokens([{"role": "user", "content": "again"}])
    assert tokenizer.decode(delta) == "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


def test_missing_turn_end():
    turn_end = [2, 201]
    assert missing_turn_end([5, 6, 2], turn_end) == [201]
    assert missing_turn_end([5, 6, 2, 201], turn_end) == []
    assert missing_turn_end([5, 6], turn_end) == [2, 201]
    assert missing_turn_end([], turn_end) == [2, 201]


def test_a_tokenizer_without_chat_template_is_refused(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    with pytest.raises(TokenizationError, match="no chat template"):
        TITOTokenizer(tokenizer)
