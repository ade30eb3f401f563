"""The engine-group calls over gRPC (issue 39 item 3): a trainer drives a vLLM replica's weight-transfer engine
group through the replica's gRPC server (JoinEngineGroup, StartEngineUpdate, EngineUpdate, FinishEngineUpdate;
fleetrl.clients.inference_engine.RemoteEngineClient), not in process: two versions through one group, each served
exactly; bad info and a call out of turn get clear errors naming the field or the call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry

from fleetrl.clients.inference import InferenceClient
from fleetrl.clients.inference_engine import RemoteEngineClient
from fleetrl.rpc import create_grpc_server
from fleetrl.services.inference.metrics import InferenceMetrics
from fleetrl.services.inference.servicer import InferenceServicer
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights import WeightPublisher
from fleetrl.weights.engine_sync import EngineSync, ReplicaInfo
from fleetrl.weights.gather import ShardedWeights
from fleetrl.weights.vllm_gloo import GlooEngineTransport
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.integration.inference.engine_group import (
    BUCKET_BYTES,
    REQUEST,
    TIMEOUT_S,
    perturb_in_place,
    stream_loader,
)

pytestmark = VLLM_TEST_MARKS


@pytest_asyncio.fixture(loop_scope="session")
async def served(vllm_engine: Any) -> AsyncIterator[InferenceClient]:
    """The session's vLLM replica behind its gRPC server, and a client to it."""
    servicer = InferenceServicer(
        vllm_engine, InferenceMetrics(CollectorRegistry(), vllm_engine), weight_load_timeout_s=60.0
    )
    server, port = create_grpc_server([lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s)])
    await server.start()
    client = InferenceClient(f"127.0.0.1:{port}", timeout_s=60.0)
    try:
        yield client
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_versions_reach_a_replica_through_its_grpc_engine_calls(vllm_engine, served, tiny_model_dir):
    engine = vllm_engine
    original = conformance.load_reference(tiny_model_dir).state_dict()
    state = {k: v.clone() for k, v in original.items()}
    loop = asyncio.get_running_loop()
    with WeightPublisher() as publisher:
        transport = GlooEngineTransport(
            {"r0": RemoteEngineClient(served, loop, timeout_s=TIMEOUT_S)},
            ShardedWeights(state),
            stream_loader({"r0": engine}, loop, publisher),
            bucket_bytes=BUCKET_BYTES,
            timeout_s=TIMEOUT_S,
        )
        sync = EngineSync(transport)
        sync.join(ReplicaInfo("r0"))
        try:
            for seed in (61, 62):
                perturb_in_place(state, seed)
                version = engine.loaded_version + 1
                outcome = await asyncio.to_thread(sync.push, version)
                assert outcome.engine == ["r0"] and outcome.stream == [], outcome
                assert (await served.status()).loaded_version == version
                completions = await served.generate(REQUEST)
                assert all(c.versions == [version] * len(c.token_ids) for c in completions)
                reference = conformance.load_reference(tiny_model_dir, state)
                conformance.assert_logprobs_match(reference, REQUEST, completions)
            assert transport.groups_built == 1 and sync.builds == 1
            assert publisher.snapshot_counts().get("bytes_served", 0) == 0
        finally:
            sync.close()
            await conformance._restore(engine, publisher, original)


async def test_bad_engine_calls_are_refused_naming_the_field_or_the_call(served):
    stub = served._stub
    with pytest.raises(grpc.aio.AioRpcError) as bad_json:
        await stub.EngineUpdate(inference_pb2.EngineUpdateRequest(version=9, update_info_json="[1"), timeout=30)
    assert bad_json.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "update_info_json" in bad_json.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as not_object:
        await stub.JoinEngineGroup(
            inference_pb2.JoinEngineGroupRequest(engine="fleetrl_gloo", engine_init_json="[]"), timeout=30
        )
    assert not_object.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "engine_init_json must be a JSON object" in not_object.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as out_of_turn:
        await served.finish_engine_update(9, timeout_s=30)
    assert out_of_turn.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "FinishEngineUpdate" in out_of_turn.value.details()
    assert "no engine-group update in progress" in out_of_turn.value.details()
