"""The hf engine's OpenAI chat endpoint for agents (issue 30): tool calls in the hermes format come back as OpenAI
tool calls, and `stream=True` is served as server-sent events, both read by the official `openai` client."""

from __future__ import annotations

import json

import openai
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.http_api import create_app
from fleetrl.services.inference.metrics import InferenceMetrics
from tests.unit.inference.fakes import CharTokenizer, ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
CALL = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def client_of(engine: ScriptedEngine) -> openai.OpenAI:
    config = InferenceConfig(model="/models/tiny", engine="hf", served_model_name="tiny")
    app = create_app(engine, CharTokenizer(), InferenceMetrics(CollectorRegistry(), engine), config)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=TestClient(app), max_retries=0)


def test_a_tool_call_the_model_wrote_is_returned_as_an_openai_tool_call():
    client = client_of(ScriptedEngine(CALL))
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "1+2?"}], tools=TOOLS, max_tokens=200
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert choice.model_extra["token_ids"] == [ord(ch) for ch in CALL]  # the model's tokens, as generated
    # Without tools offered (or with tool_choice "none") the text stays text.
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+2?"}], max_tokens=200)
    assert plain.choices[0].message.content == CALL and plain.choices[0].message.tool_calls is None


def test_stream_true_is_served_as_events_with_the_same_message():
    client = client_of(ScriptedEngine(CALL))
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "1+2?"}],
        tools=TOOLS,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert content == "Let me add." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["add"] and json.loads(calls[0].function.arguments) == {"a": 1, "b": 2}
    assert usage.completion_tokens == len(CALL)


TOOL_ONLY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_a_streamed_reply_that_is_only_a_tool_call_carries_the_logprobs_of_the_unstreamed_one():
    """Before: the logprobs rode on the content chunk only, so a reply that was only a tool call streamed none."""
    client = client_of(ScriptedEngine(TOOL_ONLY))
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "1+2?"}], "tools": TOOLS, "max_tokens": 200}
    whole = client.chat.completions.create(**ask, logprobs=True)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    streamed = [
        entry
        for chunk in client.chat.completions.create(**ask, logprobs=True, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert len(whole.choices[0].logprobs.content) == len(TOOL_ONLY)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_a_chat_template_that_ignores_tools_is_warned_about_once_naming_the_model(caplog):
    client = client_of(ScriptedEngine(TOOL_ONLY))  # CharTokenizer's template renders no tools
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "1+2?"}], "max_tokens": 200}
    with caplog.at_level("WARNING", logger="fleetrl.openai_chat"):
        client.chat.completions.create(**ask)  # no tools: nothing to check
        for _ in range(3):
            client.chat.completions.create(**ask, tools=TOOLS)
    warnings = [r.getMessage() for r in caplog.records if "ignores `tools`" in r.getMessage()]
    assert len(warnings) == 1 and "/models/tiny" in warnings[0]
