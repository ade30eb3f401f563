"""The OpenAI-compatible HTTP API, served for real on loopback and called with the official `openai` client."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.services.inference.server import create_server
from tests.integration.inference import conformance

pytestmark = pytest.mark.integration


@pytest.fixture
async def served(tiny_model_dir: str):
    config = InferenceConfig(
        model=tiny_model_dir,
        engine="hf",
        grpc_port=0,
        http_port=0,
        metrics_port=None,
        served_model_name="tiny",
        auth_token="key-123",
    )
    service = create_server(config, HFEngine(tiny_model_dir))
    await service.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key="key-123", max_retries=0)
    yield service, client
    await client.close()
    await service.stop()


async def test_models_lists_the_served_model(served):
    _, client = served
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_text_completion_with_logprobs_and_token_ids(served, tiny_model_dir):
    _, client = served
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = await client.completions.create(
        model="tiny",
        prompt="The answer is",
        max_tokens=8,
        n=2,
        temperature=0.8,
        seed=4,
        logprobs=0,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 16
    prompt_ids = tok.encode("The answer is")
    model = conformance.load_reference(tiny_model_dir)
    request = SamplingRequest(prompt_ids, n=1, max_tokens=8, temperature=0.8, top_k=50)
    for choice in reply.choices:
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt_ids
        assert len(extra["token_ids"]) == 8 and choice.finish_reason == "length"
        assert choice.text == tok.decode(extra["token_ids"], skip_special_tokens=True)
        assert choice.logprobs.token_logprobs == extra["token_logprobs"]
        assert extra["versions"] == [0] * 8
        completion = _as_completion(extra, len(prompt_ids))
        conformance.assert_logprobs_match(model, request, [completion])


async def test_token_id_prompts_and_stop_strings(served, tiny_model_dir):
    _, client = served
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = await client.completions.create(
        model="tiny",
        prompt=[[5, 6, 7], [8, 9]],
        max_tokens=20,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert len(reply.choices) == 2
    assert reply.choices[1].model_extra["prompt_token_ids"] == [8, 9]
    text = reply.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick another seed: {text!r}"
    again = await client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=20,
        seed=1,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = again.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert text.startswith(choice.text)
    # The tokens are cut too: they end with the token that completed the stop string.
    ids = choice.model_extra["token_ids"]
    assert stop in tok.decode(ids, skip_special_tokens=True)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)


async def test_chat_completion_applies_the_template(served, tiny_model_dir):
    _, client = served
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, logprobs=True, seed=3)
    choice = reply.choices[0]
    expected_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert choice.model_extra["prompt_token_ids"] == tok.encode(expected_prompt)
    assert choice.message.role == "assistant"
    ids = choice.model_extra["token_ids"]
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert [x.logprob for x in choice.logprobs.content] == choice.model_extra["token_logprobs"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in ids[:-1]
    assert choice.finish_reason == ("stop" if ids[-1] in (im_end, tok.eos_token_id) else "length")


async def test_errors_are_openai_shaped(served):
    service, client = served
    with pytest.raises(openai.BadRequestError, match="top_p"):
        await client.completions.create(model="tiny", prompt="x", top_p=5.0)
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        await client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="stream"):
        await client.completions.create(model="tiny", prompt="x", stream=True)
    bad = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()


def _as_completion(extra: dict, prompt_len: int):
    from fleetrl.clients.inference_types import Completion

    return Completion(extra["token_ids"], extra["token_logprobs"], "length", prompt_len, extra["versions"])
