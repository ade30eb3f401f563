"""The vLLM engine behind the real servers: gRPC (Generate, Status, LoadWeights, health, /metrics) and vLLM's own
OpenAI serving layer on the same engine, called with the official `openai` client (more: test_vllm_openai.py).

The servers wrap the session's shared vLLM engine (conftest.py; `start(start_engine=False)`, so stopping the
servers leaves the engine running for the other tests). Leaves the engine serving the model's own weights.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import pytest_asyncio

pytest.importorskip("vllm")

import openai
import torch
from transformers import AutoTokenizer

from fleetrl.clients.inference import InferenceClient
from fleetrl.clients.inference_types import Completion, SamplingRequest
from fleetrl.rpc import check_health, open_channel
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights import WeightPublisher, fetch_weights
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.integration.inference.served import serve

pytestmark = VLLM_TEST_MARKS
TOKEN = "tok-vllm"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_service(vllm_engine, tiny_model_dir):
    async with serve(vllm_engine, tiny_model_dir, model="tiny", token=TOKEN) as service:
        yield service


async def test_grpc_generate_status_and_load_weights(vllm_service, tiny_model_dir):
    engine = vllm_service.engine
    version = engine.loaded_version
    request = SamplingRequest([3, 4, 5], n=3, max_tokens=12, temperature=0.7, top_k=40, seed=11)
    async with InferenceClient(f"127.0.0.1:{vllm_service.grpc_port}", auth_token=TOKEN) as client:
        channel = open_channel(f"127.0.0.1:{vllm_service.grpc_port}", TOKEN)
        async with channel:
            assert await check_health(channel) == "SERVING"
        completions = await client.generate(request, timeout_s=60)
        conformance.assert_well_formed(request, completions)
        conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir), request, completions)
        assert [c.token_ids for c in completions] == [c.token_ids for c in await engine.generate(request)]
        status = await client.status()
        assert (status.engine, status.loaded_version) == ("vllm", version)

        original = conformance.load_reference(tiny_model_dir).state_dict()
        new_state = conformance._perturbed(original, seed=31)
        with WeightPublisher(auth_token=TOKEN) as publisher:
            manifest = publisher.publish(version + 1, new_state)
            result = await client.load_weights(version + 1, publisher.address, timeout_s=60)
            assert (result.version, result.checksum) == (version + 1, manifest.checksum)
            assert result.pause_s > 0 and result.transfer_s > 0
            after = await client.generate(request, timeout_s=60)
            assert all(c.versions == [version + 1] * len(c.token_ids) for c in after)
            conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir, new_state), request, after)
            status = await client.status()
            assert (status.loaded_version, status.loaded_checksum) == (version + 1, manifest.checksum)
            publisher.publish(version + 2, original)
            await client.load_weights(version + 2, publisher.address, timeout_s=60)

    with urllib.request.urlopen(f"http://127.0.0.1:{vllm_service.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert f"fleetrl_inference_loaded_version {float(version + 2)}" in text
    assert "fleetrl_inference_weight_load_pause_seconds_count 2.0" in text


async def test_openai_client_completions_and_chat(vllm_service, tiny_model_dir):
    """vLLM's own OpenAI serving layer on the shared engine: its token ids (`return_token_ids`) and logprobs are the
    engine's processed logprobs, exact against a transformers recompute."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{vllm_service.http_port}/v1", api_key=TOKEN, max_retries=0)
    try:
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        reply = await client.completions.create(
            model="tiny",
            prompt="The answer is",
            max_tokens=8,
            n=2,
            temperature=0.8,
            seed=4,
            logprobs=0,
            extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True},
        )
        prompt_ids = tok.encode("The answer is")
        request = SamplingRequest(prompt_ids, max_tokens=8, temperature=0.8, top_k=50)
        model = conformance.load_reference(tiny_model_dir)
        for choice in reply.choices:
            extra = choice.model_extra
            assert extra["prompt_token_ids"] == prompt_ids and len(extra["token_ids"]) == 8
            # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence
            assert choice.text == tok.decode(extra["token_ids"], skip_special_tokens=True).rstrip("\ufffd")
            logprobs = choice.logprobs.token_logprobs
            completion = Completion(extra["token_ids"], logprobs, "length", len(prompt_ids), [0] * 8)
            conformance.assert_logprobs_match(model, request, [completion])

        messages = [{"role": "user", "content": "Hi!"}]
        chat = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, seed=3, extra_body={"return_token_ids": True}
        )
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat.model_extra["prompt_token_ids"] == tok.encode(expected)
        assert chat.choices[0].message.role == "assistant"
    finally:
        await client.close()


async def test_a_relayed_load_reaches_the_vllm_worker_through_the_replicas_relay(vllm_service, tiny_model_dir):
    """weight_fanout = chain/tree on the vLLM engine: the replica's relay fetches the version, the vLLM worker loads
    it from the relay on loopback, and a peer then fetches the same bytes from the relay, not the trainer."""
    engine = vllm_service.engine
    version = engine.loaded_version
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=41)
    request = SamplingRequest([3, 4, 5], n=2, max_tokens=8, temperature=0.7, seed=5)
    async with open_channel(f"127.0.0.1:{vllm_service.grpc_port}", TOKEN) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with WeightPublisher(auth_token=TOKEN) as publisher:
            manifest = publisher.publish(version + 1, new_state)
            load = inference_pb2.LoadWeightsRequest(
                version=version + 1, source=publisher.address, timeout_s=60, relay=True
            )
            reply = await stub.LoadWeights(load, timeout=90)
            assert (reply.version, reply.checksum) == (version + 1, manifest.checksum)
            status = await stub.Status(inference_pb2.StatusRequest(), timeout=10)
            assert status.relay_version == version + 1 and status.relay_address
            served = publisher.snapshot_counts()["bytes_served"]
            assert served == sum(t.numel() * t.element_size() for t in new_state.values())  # one copy
            peer_manifest, tensors = await asyncio.to_thread(
                fetch_weights, status.relay_address, version + 1, auth_token=TOKEN, timeout_s=30
            )
            assert peer_manifest.checksum == manifest.checksum and publisher.snapshot_counts()["bytes_served"] == served
            assert all(torch.equal(tensors[name], new_state[name].contiguous()) for name in tensors)
            after = await engine.generate(request)
            assert all(c.versions == [version + 1] * len(c.token_ids) for c in after)
            conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir, new_state), request, after)
            publisher.publish(version + 2, original)
            restore = inference_pb2.LoadWeightsRequest(version=version + 2, source=publisher.address, timeout_s=60)
            await stub.LoadWeights(restore, timeout=90)
