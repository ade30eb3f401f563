"""The OpenAI chat format pieces (fleetrl.openai_chat): hermes tool-call parsing, messages as templates read them,
stop-string cuts and the event stream."""

from __future__ import annotations

import json

import pytest

from fleetrl.openai_chat import (
    ChatRequestError,
    assistant_message,
    chat_completion_body,
    parse_tool_calls,
    stop_text_cut,
    stream_events,
    template_messages,
    token_logprobs,
    token_texts,
)


def test_tool_calls_are_parsed_and_a_malformed_block_leaves_the_text():
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "f"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "ok"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1}),
        ("f", {}),
    ]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name
    message, finish = assistant_message(text, "stop", tools_offered=True, tool_choice="none")
    assert (message["content"], finish) == (text, "stop")


def test_messages_are_given_to_templates_as_text_with_argument_dicts():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": 2}'}}],
        },
    ]
    user, assistant = template_messages(messages)
    assert user["content"] == "ab" and assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"x": 2}
    with pytest.raises(ChatRequestError, match=r"messages\[0\].content\[0\]"):
        template_messages([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatRequestError, match="messages: must be a non-empty list"):
        template_messages([])


def test_stop_cut_and_stream_events():
    assert stop_text_cut("abc\ndef", ["\n"]) == "abc" and stop_text_cut("abc", None) == "abc"
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "token_ids": [1]}
    body = chat_completion_body("m", [choice], {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    events = stream_events(body, include_usage=True)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hi"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-2]["choices"][0]["token_ids"] == [1]
    assert chunks[-1]["usage"]["total_tokens"] == 2


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_logprob_entries_carry_each_tokens_text_and_utf8_bytes_not_the_vocabulary_symbol(tiny_tokenizer):
    text = "a\nb é 😀 «x»"
    ids = [*tiny_tokenizer.encode(text, add_special_tokens=False), tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    entries = token_logprobs(tiny_tokenizer, ids, [-0.5] * len(ids))["content"]
    newline = tiny_tokenizer.encode("\n", add_special_tokens=False)
    assert tiny_tokenizer.convert_ids_to_tokens(newline) == ["Ċ"]  # the symbol the entries used to carry
    assert token_logprobs(tiny_tokenizer, newline, [0.0])["content"][0] | {"logprob": 0} == {
        "token": "\n", "logprob": 0, "bytes": [10], "top_logprobs": []
    }  # fmt: skip
    assert b"".join(bytes(e["bytes"]) for e in entries) == (text + "<|im_end|>").encode()  # exact, byte for byte
    whole = [e for e in entries if "\ufffd" not in e["token"]]  # tokens holding whole characters read as text
    assert all(e["token"].encode() == bytes(e["bytes"]) for e in whole) and entries[-1]["token"] == "<|im_end|>"
    assert [t for t, _ in token_texts(tiny_tokenizer, ids)] == [e["token"] for e in entries]
