"""vLLM-specific weight-swap behaviour beyond the shared conformance suite.

- Tokens of a completion that spans a swap are exact for the version they are labelled with (the swap clears
  the KV cache, so kept requests recompute their context with the new weights).
- Staging (fetch + verify + validate) runs while generation continues; only the swap pauses it.
- An incomplete transfer (the publisher goes away mid-fetch) and a stale version are rejected and the old
  version keeps serving; the worker extension reports the expected weights over collective_rpc.

Uses the session's shared vLLM engine (conftest.py) and leaves it serving the model's own weights.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

pytest.importorskip("vllm")

from safetensors import safe_open

from fleetrl.clients.inference_types import SamplingRequest, WeightLoadError
from fleetrl.weights import WeightPublisher
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.waiting import async_wait_until

pytestmark = VLLM_TEST_MARKS


class _SlowPublisher(WeightPublisher):
    """Serves each chunk after a delay, so a fetch takes seconds."""

    delay_s = 0.1

    def _chunk_payload(self, *args):
        time.sleep(self.delay_s)
        return super()._chunk_payload(*args)


async def _restore(engine, original) -> None:
    with WeightPublisher() as publisher:
        version = engine.loaded_version + 1
        publisher.publish(version, original)
        await engine.load_weights(version, publisher.address, timeout_s=60)


async def test_tokens_spanning_a_swap_are_exact_for_their_version(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=11)
    old = vllm_engine.loaded_version
    request = SamplingRequest([11, 12, 13], n=2, max_tokens=600, ignore_eos=True, seed=21)
    with WeightPublisher() as publisher:
        publisher.publish(old + 1, new_state)
        task = asyncio.create_task(vllm_engine.generate(request))
        try:
            await conformance.wait_generating(vllm_engine, task)
            assert not task.done(), "the completions finished before the swap; make them longer"
            await vllm_engine.load_weights(old + 1, publisher.address, timeout_s=60)
            completions = await asyncio.wait_for(task, 120)
        finally:
            task.cancel()
    references = {
        old: conformance.load_reference(tiny_model_dir),
        old + 1: conformance.load_reference(tiny_model_dir, new_state),
    }
    for c in completions:
        runs = [(v, len(list(g))) for v, g in itertools.groupby(c.versions)]
        assert [v for v, _ in runs] == [old, old + 1], f"versions per token: {runs}"
        for version, model in references.items():
            ref = conformance.reference_logprobs(model, request.prompt_token_ids, c.token_ids, 1.0, 0, 1.0)
            diffs = [abs(g - r) for g, r, v in zip(c.logprobs, ref, c.versions, strict=True) if v == version]
            assert diffs and max(diffs) < conformance.LOGPROB_TOL, (
                f"tokens labelled version {version} do not match that version's forward: max |diff| {max(diffs)}"
            )
    await _restore(vllm_engine, original)


async def test_generation_continues_while_weights_stage(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    version = vllm_engine.loaded_version + 1
    with _SlowPublisher(chunk_bytes=64 << 10) as publisher:
        publisher.publish(version, original)
        load = asyncio.create_task(vllm_engine.load_weights(version, publisher.address, timeout_s=60))
        await async_wait_until(lambda: publisher.snapshot_counts().get("requests"), 30, "the fetch to start")
        served = 0
        while not load.done():
            (c,) = await vllm_engine.generate(SamplingRequest([40, 41], max_tokens=16, seed=served))
            assert c.versions == [version - 1] * len(c.token_ids)
            served += 1
            if served >= 3:
                break
        assert not load.done(), "the transfer was too quick to overlap generation"
        result = await load
    # Staging overlapped generation: three requests were served on the old version while the load ran (a
    # pause_s < transfer_s check would be a race with the machine's load, so none).
    assert served >= 3
    assert result.transfer_s > 1.0  # one-sided: the slow publisher alone takes that long
    assert vllm_engine.loaded_version == version


async def test_incomplete_transfer_and_stale_version_are_rejected(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    version = vllm_engine.loaded_version
    request = SamplingRequest([100, 7, 250], n=2, max_tokens=10, seed=4)
    before = await vllm_engine.generate(request)

    publisher = _SlowPublisher(chunk_bytes=32 << 10)
    publisher.publish(version + 1, conformance._perturbed(original, seed=5))
    load = asyncio.create_task(vllm_engine.load_weights(version + 1, publisher.address, timeout_s=3))
    # The manifest and a first chunk are served: the fetch is under way.
    await async_wait_until(lambda: publisher.snapshot_counts().get("requests", 0) >= 2, 30, "the fetch to start")
    await asyncio.to_thread(publisher.close)  # the publisher disappears mid-transfer
    with pytest.raises(WeightLoadError, match=f"version {version + 1}"):
        await asyncio.wait_for(load, 30)

    with WeightPublisher() as fresh:
        fresh.publish(version, original)
        with pytest.raises(WeightLoadError, match="not newer"):
            await vllm_engine.load_weights(version, fresh.address, timeout_s=10)

    assert vllm_engine.loaded_version == version
    after = await vllm_engine.generate(request)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert all(c.versions == [version] * len(c.token_ids) for c in after)


async def test_worker_extension_reports_the_checkpoint_layout(vllm_engine, tiny_model_dir):
    (spec,) = await vllm_engine._rpc("fleetrl_weight_spec")
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        expected = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert {name: shape for name, (shape, _) in spec["tensors"].items()} == expected
    assert {dtype for _, dtype in spec["tensors"].values()} == {"float32"}
    assert spec["optional"] == []  # the tiny model does not tie its embeddings


async def test_swaps_go_through_vllms_weight_transfer_api(vllm_engine, tiny_model_dir):
    """The staged copy is applied with start_weight_update / update_weights / finish_weight_update(version) on the
    "fleetrl_zmq" backend: vLLM's own weight version moves with it, and the pause is split by those calls."""
    original = conformance.load_reference(tiny_model_dir).state_dict()
    with WeightPublisher() as publisher:
        version = vllm_engine.loaded_version + 1
        publisher.publish(version, conformance._perturbed(original, seed=11))
        await vllm_engine.load_weights(version, publisher.address, timeout_s=60)
    assert await vllm_engine._llm.get_weight_version() == str(version)
    assert set(vllm_engine.last_swap_timings) == {
        "pause_generation_s",
        "update_weights_s",
        "finish_weight_update_s",
        "resume_s",
    }
    await _restore(vllm_engine, original)


async def test_the_backend_alone_fetches_a_version_named_by_its_stream(vllm_engine, tiny_model_dir):
    """What a client that knows only vLLM's API sends: update_info with the stream's address (no staged copy).
    The weights then serve exactly: logprobs match a float32 forward of the new weights."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    original = conformance.load_reference(tiny_model_dir).state_dict()
    new_state = conformance._perturbed(original, seed=12)
    llm = vllm_engine._llm
    async with vllm_engine._load_lock:  # nothing else loads meanwhile
        version = vllm_engine.loaded_version + 1
        with WeightPublisher() as publisher:
            publisher.publish(version, new_state)
            await llm.pause_generation(mode="keep", clear_cache=True)
            try:
                await llm.start_weight_update()
                info = {"version": version, "address": publisher.address, "timeout_s": 30.0}
                await llm.update_weights(WeightTransferUpdateRequest(update_info=info))
                await llm.finish_weight_update(str(version))
            finally:
                await llm.resume_generation()
        vllm_engine.loaded_version = version
    request = SamplingRequest(conformance.PROMPTS[0], n=2, max_tokens=12, seed=5)
    completions = await vllm_engine.generate(request)
    assert all(c.versions == [version] * len(c.token_ids) for c in completions)
    worst = conformance.assert_logprobs_match(
        conformance.load_reference(tiny_model_dir, new_state), request, completions
    )
    assert worst < conformance.LOGPROB_TOL
    await _restore(vllm_engine, original)
