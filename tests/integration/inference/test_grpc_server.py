"""The inference gRPC server, started for real on a loopback port 0, called through fleetrl.rpc channels."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from transformers import AutoModelForCausalLM

from fleetrl.clients.inference import InferenceClient
from fleetrl.clients.inference_proto import completions_from_proto
from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.rpc import check_health, open_channel
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.services.inference.server import create_server
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights import WeightPublisher
from tests.integration.inference import conformance

pytestmark = pytest.mark.integration


@pytest.fixture
async def service(tiny_model_dir: str):
    config = InferenceConfig(
        model=tiny_model_dir,
        engine="hf",
        grpc_port=0,
        http_port=None,
        metrics_port=0,
        auth_token="tok",
    )
    service = create_server(config, HFEngine(tiny_model_dir))
    await service.start()
    yield service
    await service.stop()


def _stub(service, token: str | None = "tok"):
    channel = open_channel(f"127.0.0.1:{service.grpc_port}", auth_token=token)
    return channel, inference_pb2_grpc.InferenceStub(channel)


async def test_generate_returns_exact_logprobs_and_versions(service, tiny_model_dir):
    channel, stub = _stub(service)
    async with channel:
        assert await check_health(channel) == "SERVING"
        msg = inference_pb2.GenerateRequest(
            prompt_token_ids=[3, 4, 5], n=3, max_tokens=12, temperature=0.7, top_k=40, seed=11
        )
        reply = await stub.Generate(msg, timeout=30)
    completions = completions_from_proto(reply)
    request = SamplingRequest([3, 4, 5], n=3, max_tokens=12, temperature=0.7, top_k=40, seed=11)
    conformance.assert_well_formed(request, completions)
    conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir), request, completions)
    # The server adds nothing: the same request in-process gives the same tokens.
    direct = await service.engine.generate(request)
    assert [c.token_ids for c in direct] == [c.token_ids for c in completions]


async def test_defaults_and_invalid_requests(service):
    channel, stub = _stub(service)
    async with channel:
        reply = await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[1]), timeout=30)
        assert len(reply.completions) == 1  # n 0 -> 1, temperature unset -> 1.0
        assert 1 <= len(reply.completions[0].token_ids) <= 64
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[10**6]), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_token_ids" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[1], top_p=2.0))
        assert "top_p" in info.value.details()


async def test_auth_is_enforced(service):
    channel, stub = _stub(service, token=None)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Status(inference_pb2.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_status_load_weights_and_metrics(service, tiny_model_dir):
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    channel, stub = _stub(service)
    async with channel:
        await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=5))
        status = await stub.Status(inference_pb2.StatusRequest(), timeout=10)
        assert (status.engine, status.model, status.loaded_version) == ("hf", tiny_model_dir, 0)
        assert status.generated_tokens >= 1 and status.requests >= 1
        with WeightPublisher() as publisher:
            manifest = publisher.publish(1, {k: v * 1.01 for k, v in original.items()})
            reply = await stub.LoadWeights(
                inference_pb2.LoadWeightsRequest(version=1, source=publisher.address), timeout=60
            )
            assert (reply.version, reply.checksum) == (1, manifest.checksum)
            publisher.publish(2, {**original, "lm_head.weight": original["lm_head.weight"][:10]})
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.LoadWeights(
                    inference_pb2.LoadWeightsRequest(version=2, source=publisher.address), timeout=60
                )
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "lm_head.weight: shape" in info.value.details()
        status = await stub.Status(inference_pb2.StatusRequest(), timeout=10)
        assert (status.loaded_version, status.loaded_checksum) == (1, manifest.checksum)
        reply = await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[1], max_tokens=3))
        assert list(reply.completions[0].versions) == [1] * len(reply.completions[0].token_ids)
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    assert 'fleetrl_inference_requests_total{api="grpc",outcome="ok"} 2.0' in text
    assert "fleetrl_inference_loaded_version 1.0" in text
    assert 'fleetrl_inference_weight_loads_total{outcome="ok"} 1.0' in text
    assert 'fleetrl_inference_weight_loads_total{outcome="rejected"} 1.0' in text
    assert "fleetrl_inference_weight_load_pause_seconds_count 1.0" in text
    assert "fleetrl_inference_weight_load_transfer_seconds_count 1.0" in text
    assert "fleetrl_inference_generated_tokens_total" in text
    assert "fleetrl_inference_in_flight_requests 0.0" in text
    assert "fleetrl_inference_tokens_per_second" in text


async def test_the_python_client(service, tiny_model_dir):
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    request = SamplingRequest([7, 8], n=2, max_tokens=6, temperature=0.5, seed=2, ignore_eos=True)
    async with InferenceClient(f"127.0.0.1:{service.grpc_port}", auth_token="tok") as client:
        completions = await client.generate(request)
        assert [len(c.token_ids) for c in completions] == [6, 6]
        direct = await service.engine.generate(request)
        assert [c.token_ids for c in direct] == [c.token_ids for c in completions]
        with WeightPublisher() as publisher:
            manifest = publisher.publish(4, state)
            result = await client.load_weights(4, publisher.address, timeout_s=60)
        assert (result.version, result.checksum) == (4, manifest.checksum)
        assert (await client.status()).loaded_version == 4
