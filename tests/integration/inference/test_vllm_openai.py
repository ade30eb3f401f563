"""vLLM's own OpenAI serving layer on the session's shared vLLM engine (services/inference/vllm_openai.py), called
with the official `openai` client: streaming, tool calls parsed by the `hermes` parser, top_logprobs, stop strings
inside the engine, the run's token on every route but /health, and the policy-version headers.

The tool call is forced with a structured-outputs regex: the random tiny model has no skill, what is tested is that
the tiny model's template renders the tools and that vLLM parses the <tool_call> text into `tool_calls`.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import pytest_asyncio

pytest.importorskip("vllm")


from fleetrl.services.inference.http_auth import VERSION_HEADER, VERSION_MAX_HEADER
from fleetrl.weights import WeightPublisher
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.integration.inference.served import serve_with_client

pytestmark = VLLM_TEST_MARKS
TOKEN = "tok-openai"
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(vllm_engine, tiny_model_dir):
    """The inference service (gRPC + vLLM's OpenAI app) on the shared engine, and an openai client for it."""
    async with serve_with_client(vllm_engine, tiny_model_dir, model=MODEL, token=TOKEN) as served:
        yield served


def _base(service) -> str:
    return f"http://127.0.0.1:{service.http_port}"


async def test_streaming_chat_sends_chunks_with_the_same_text_as_a_plain_request(served):
    _, client = served
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    plain = await client.chat.completions.create(**params)
    stream = await client.chat.completions.create(stream=True, **params)
    chunks, text, finish = 0, "", None
    async for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert chunks > 2
    assert finish == "length" == plain.choices[0].finish_reason
    assert text == plain.choices[0].message.content


async def test_the_template_renders_the_tools_into_the_prompt(served):
    service, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=_base(service), headers=auth, timeout=60) as http:
        body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True}
        bare = (await http.post("/tokenize", json=body)).json()["tokens"]
        with_tools = (await http.post("/tokenize", json={**body, "tools": TOOLS})).json()["tokens"]
        prompt = (await http.post("/detokenize", json={"model": MODEL, "tokens": with_tools})).json()["prompt"]
    assert "<tools>" in prompt and '"get_weather"' in prompt and len(with_tools) > len(bare)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_call_is_parsed_into_tool_calls(served, stream):
    _, client = served
    forced = re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", FORCED_CALL)  # a literal regex: metacharacters escaped
    params = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=300,
        temperature=0,
        extra_body={"structured_outputs": {"regex": forced}},
    )
    if not stream:
        choice = (await client.chat.completions.create(**params)).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        assert calls == [("get_weather", {"city": "Paris"})]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        return
    names, arguments, finish = [], "", None
    async for chunk in await client.chat.completions.create(stream=True, **params):
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            names += [call.function.name] if call.function and call.function.name else []
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert finish == "tool_calls"


async def test_top_logprobs_come_with_every_token(served):
    _, client = served
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        logprobs=True,
        top_logprobs=5,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == 5
    for token in tokens:  # vLLM lists the sampled token (wherever it ranks), then the most likely ones
        top = {t.token: t.logprob for t in token.top_logprobs}
        assert len(top) == 5 and all(x <= 0 for x in top.values())
        assert top[token.token] == token.logprob <= max(top.values())


async def test_a_stop_string_ends_generation_inside_the_engine(served):
    _, client = served
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = (await client.chat.completions.create(**params)).choices[0].message.content
    start = next(i for i in range(len(full) // 2, len(full) - 3) if len(full[i : i + 3].strip()) == 3)
    stop = full[start : start + 3]
    reply = await client.chat.completions.create(stop=[stop], **params)
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40  # the engine stopped; not a cut after 40 tokens
    assert stop not in content and full.startswith(content) and len(content) < len(full)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_every_route_but_health_needs_the_token(served, path):
    service, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=_base(service), timeout=60) as http:
        missing = await http.post(path, json=body)
        wrong = await http.post(path, json=body, headers={"Authorization": "Bearer not-the-token"})
        right = await http.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        health = await http.get("/health")
    assert (missing.status_code, wrong.status_code, right.status_code, health.status_code) == (401, 401, 200, 200)
    assert missing.json()["error"]["type"] == "auth_error"


async def test_no_development_routes_are_served(served):
    """VLLM_SERVER_DEV_MODE stays off and the elastic scaling routes are dropped: no HTTP route pauses, rescales or
    swaps the weights of the engine behind fleetrl's back."""
    service, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=_base(service), headers=auth, timeout=60) as http:
        for path in ("/pause", "/update_weights", "/collective_rpc", "/sleep", "/scale_elastic_ep"):
            assert (await http.post(path, json={})).status_code == 404, path


async def test_responses_carry_the_policy_versions_that_served_them(served, tiny_model_dir):
    service, _ = served
    engine = service.engine
    version = engine.loaded_version
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=_base(service), headers=auth, timeout=60) as http:
        before = await http.post("/v1/chat/completions", json=body)
        assert (before.headers[VERSION_HEADER], before.headers[VERSION_MAX_HEADER]) == (str(version), str(version))
        state = conformance.load_reference(tiny_model_dir).state_dict()  # the same weights: behaviour unchanged
        with WeightPublisher(auth_token=TOKEN) as publisher:
            publisher.publish(version + 1, state)
            await engine.load_weights(version + 1, publisher.address, auth_token=TOKEN, timeout_s=60)
        after = await http.post("/v1/chat/completions", json=body)
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
            lines = [line async for line in streamed.aiter_lines() if line.startswith("data:")]
    assert (after.headers[VERSION_HEADER], after.headers[VERSION_MAX_HEADER]) == (str(version + 1),) * 2
    assert streamed.headers[VERSION_HEADER] == str(version + 1) and lines[-1] == "data: [DONE]"
    registry = service.registry
    assert registry.get_sample_value("fleetrl_inference_requests_total", {"api": "chat", "outcome": "ok"}) >= 3
