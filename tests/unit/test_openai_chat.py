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
