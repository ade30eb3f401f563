"""services/inference/http_api.py: the OpenAI routes' handlers on a scripted engine and a character tokenizer
(no model, no sockets; the auth middleware of http_auth.py and body validation through FastAPI's in-memory
client)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from fleetrl.clients.inference_types import Completion
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.http_api import (
    BadRequest,
    ChatBody,
    CompletionBody,
    OpenAIApi,
    completion_prompts,
    create_app,
    stop_completion,
)
from fleetrl.services.inference.http_auth import AuthVersionMiddleware
from fleetrl.services.inference.metrics import InferenceMetrics
from tests.unit.inference.fakes import END_OF_TURN_ID, CharTokenizer, ScriptedEngine


def _api(engine: ScriptedEngine | None = None, **config: object) -> OpenAIApi:
    engine = engine or ScriptedEngine()
    settings = {"model": "/models/tiny", "engine": "hf", "served_model_name": "tiny", **config}
    metrics = InferenceMetrics(CollectorRegistry(), engine)
    return OpenAIApi(engine, CharTokenizer(), metrics, InferenceConfig(**settings))


def _requests(api: OpenAIApi, route: str, outcome: str) -> float | None:
    labels = {"api": route, "outcome": outcome}
    return api.metrics.registry.get_sample_value("fleetrl_inference_requests_total", labels)


async def test_models_lists_the_served_model() -> None:
    api = _api(ScriptedEngine(max_len=128))
    (card,) = (await api.models())["data"]
    assert (card["id"], card["root"], card["max_model_len"]) == ("tiny", "/models/tiny", 128)


async def test_a_text_completion_is_cut_at_a_stop_string() -> None:
    api = _api()
    body = CompletionBody(prompt="hi", max_tokens=20, n=2, stop=["o w"], logprobs=0)
    reply = await api.complete(body)
    assert [c["text"] for c in reply["choices"]] == ["hell", "hell"]
    choice = reply["choices"][1]
    assert choice["index"] == 1 and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [ord(ch) for ch in "hello w"]  # the tokens that reach the stop string
    assert choice["logprobs"]["tokens"] == list("hello w") and choice["prompt_token_ids"] == [ord("h"), ord("i")]
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 14, "total_tokens": 16}
    assert reply["model"] == "tiny" and reply["object"] == "text_completion"
    assert _requests(api, "completions", "ok") == 1


async def test_completion_defaults_and_openai_style_top_k() -> None:
    engine = ScriptedEngine()
    api = _api(engine, default_max_tokens=3)
    reply = await api.complete(CompletionBody(prompt=[[5, 6], [7]], top_k=-1))
    assert [c["text"] for c in reply["choices"]] == ["hel", "hel"]
    assert [(r.prompt_token_ids, r.max_tokens, r.top_k, r.temperature, r.top_p) for r in engine.requests] == [
        ([5, 6], 3, 0, 1.0, 1.0),
        ([7], 3, 0, 1.0, 1.0),
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (CompletionBody(prompt="x", echo=True), "echo"),
        (CompletionBody(prompt="x", stream=True), "stream"),
        (CompletionBody(prompt="x", model="gpt-4"), "unknown model"),
        (CompletionBody(prompt=[]), "prompt: must not be empty"),
        (CompletionBody(prompt=[[1], []]), "prompt: must not be empty"),
    ],
)
async def test_refused_completions_name_the_field(body: CompletionBody, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        await _api().complete(body)


async def test_errors_become_openai_shaped_400_and_503() -> None:
    reply = await _api().completions(CompletionBody(prompt="x", top_p=5.0))  # the engine's ValueError
    assert reply.status_code == 400 and "top_p" in json.loads(reply.body)["error"]["message"]
    reply = await _api(ScriptedEngine(fail=True)).completions(CompletionBody(prompt="x"))
    assert reply.status_code == 503 and json.loads(reply.body)["error"]["type"] == "engine_error"
    reply = await _api().chat(ChatBody(messages=[]))
    assert reply.status_code == 400 and "messages" in json.loads(reply.body)["error"]["message"]


async def test_a_chat_completion_stops_at_end_of_turn_and_fills_the_context() -> None:
    engine = ScriptedEngine("ok. done", max_len=100)
    api = _api(engine)
    reply = await api.chat_complete(ChatBody(messages=[{"role": "user", "content": "hi"}], stop=".", logprobs=True))
    (request,) = engine.requests
    prompt = CharTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert request.stop_token_ids == (END_OF_TURN_ID,) and request.max_tokens == 100 - len(prompt)
    assert request.stop == (".",)  # the engine ends generation there (this scripted one does not: cut here too)
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": "ok"} and choice["finish_reason"] == "stop"
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["o", "k", "."]
    # usage counts the completion as the engine returned it, before the stop-string cut
    assert reply["usage"]["completion_tokens"] == len("ok. done")
    assert _requests(api, "chat", "ok") == 1


def test_completion_prompts_accept_every_openai_form() -> None:
    tok = CharTokenizer()
    assert completion_prompts("ab", tok) == [[97, 98]]
    assert completion_prompts(["a", "b"], tok) == [[97], [98]]
    assert completion_prompts([3, 4], tok) == [[3, 4]]
    assert completion_prompts([[3], [4, 5]], tok) == [[3], [4, 5]]


def test_stop_completion_keeps_a_completion_without_a_stop_string() -> None:
    c = Completion([104, 105], [-1.0, -2.0], "length", 1, [0, 0])
    assert stop_completion(c, None, CharTokenizer()) == ("hi", c)
    assert stop_completion(c, ["", "x"], CharTokenizer()) == ("hi", c)


def test_stop_completion_cuts_the_tokens_at_the_one_that_completes_the_stop_and_the_text_before_it() -> None:
    c = Completion([104, 105, 33, 120, 121], [-1.0, -2.0, -3.0, -4.0, -5.0], "length", 1, [0, 0, 1, 1, 1])
    text, cut = stop_completion(c, ["!x", "zz"], CharTokenizer())
    assert text == "hi"
    assert (cut.token_ids, cut.logprobs, cut.versions) == ([104, 105, 33, 120], [-1.0, -2.0, -3.0, -4.0], [0, 0, 1, 1])
    assert cut.finish_reason == "stop"


def test_the_app_checks_the_token_and_reports_bad_bodies_as_400() -> None:
    engine = ScriptedEngine()
    config = InferenceConfig(model="/models/tiny", engine="hf", auth_token="key")
    app = create_app(engine, CharTokenizer(), InferenceMetrics(CollectorRegistry(), engine), config)
    app = AuthVersionMiddleware(app, token="key", version_fn=lambda: engine.loaded_version)  # as http_server.py does
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}  # open: liveness probes carry no token
        refused = client.get("/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "auth_error"
        authorized = {"Authorization": "Bearer key"}
        models = client.get("/v1/models", headers=authorized)
        assert models.status_code == 200 and models.headers["x-fleetrl-policy-version"] == "0"
        reply = client.post("/v1/completions", json={"max_tokens": 3}, headers=authorized)
        assert reply.status_code == 400 and "prompt" in reply.json()["error"]["message"]
        reply = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}, headers=authorized)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hel"
