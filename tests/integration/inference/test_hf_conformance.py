"""The conformance suite (conformance.py) run against the hf engine, sharing one engine per module."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from fleetrl.services.inference.hf_engine import HFEngine
from tests.integration.inference import conformance

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(tiny_model_dir: str):
    engine = HFEngine(tiny_model_dir, max_num_seqs=32)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.shutdown())


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.8), (0.7, 30, 0.9)],
)
async def test_logprobs_match_a_float32_recompute(engine, tiny_model_dir, temperature, top_k, top_p):
    worst = await conformance.check_logprobs_exact(engine, tiny_model_dir, temperature, top_k, top_p)
    assert worst < conformance.LOGPROB_TOL


async def test_n_completions(engine, tiny_model_dir):
    await conformance.check_n_completions(engine, tiny_model_dir)


async def test_max_tokens_finishes_with_length(engine, tiny_model_dir):
    await conformance.check_max_tokens_and_length(engine, tiny_model_dir)


async def test_stop_token_ids_finish_with_stop(engine, tiny_model_dir):
    await conformance.check_stop_token_ids(engine, tiny_model_dir)


async def test_a_stop_string_ends_generation_in_the_engine(engine, tiny_model_dir):
    await conformance.check_stop_strings(engine, tiny_model_dir)


async def test_eos_stops(engine, tiny_model_dir):
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id
    await conformance.check_eos_stops(engine, tiny_model_dir, eos)


async def test_seeded_determinism(engine, tiny_model_dir):
    await conformance.check_seeded_determinism(engine, tiny_model_dir)


async def test_seeds_give_each_completion_its_own_seed(engine, tiny_model_dir):
    await conformance.check_seeds_per_completion(engine, tiny_model_dir)


async def test_versions_per_token(engine, tiny_model_dir):
    await conformance.check_versions_per_token(engine, tiny_model_dir)


async def test_invalid_requests_name_the_field(engine, tiny_model_dir):
    await conformance.check_invalid_requests(engine, tiny_model_dir)


async def test_load_weights_from_a_real_publisher(engine, tiny_model_dir):
    await conformance.check_load_weights(engine, tiny_model_dir)


async def test_bad_weight_loads_are_rejected_and_old_version_serves(engine, tiny_model_dir):
    await conformance.check_bad_loads_rejected(engine, tiny_model_dir)


async def test_a_swap_mid_generation_versions_tokens(engine, tiny_model_dir):
    await conformance.check_swap_mid_generation(engine, tiny_model_dir)


async def test_an_idle_engine_keeps_no_copy_of_the_weights_it_received(engine, monkeypatch):
    """After a swap the received tensors (a whole model for a full version) are dropped even while the engine
    idles (its worker kept the last swap, and with it the copy, until its next step). They are views of the
    engine's receive buffer, which the next version reuses and which goes back to the OS once the engine had no
    load for `receive_idle_s` (the next test)."""
    import gc
    import weakref

    import fleetrl.weights
    from fleetrl.weights import WeightPublisher
    from fleetrl.weights.fetch import fetch_weights

    refs: list[weakref.ref] = []

    def recording_fetch(*args, **kwargs):
        manifest, tensors = fetch_weights(*args, **kwargs)
        refs.extend(weakref.ref(t) for t in tensors.values())
        return manifest, tensors

    monkeypatch.setattr(fleetrl.weights, "fetch_weights", recording_fetch, raising=False)
    version = engine.loaded_version + 1
    publisher = WeightPublisher()
    try:
        publisher.publish(version, {n: t.detach().clone() for n, t in engine._state.items()})
        await engine.load_weights(version, publisher.address)
    finally:
        publisher.close()
    gc.collect()
    assert refs and engine.loaded_version == version
    assert [r for r in refs if r() is not None] == []


async def test_versions_are_received_into_one_buffer_given_back_when_idle(tiny_model_dir):
    """Every version lands in the same receive buffer (fresh memory for each one cost a page fault per 4 KiB on
    every load: docs/benchmarks.md, "The CPU weight path, before and after"); with no load for `receive_idle_s`
    the buffer is released."""
    from fleetrl.weights import WeightPublisher
    from tests.waiting import async_wait_until

    engine = HFEngine(tiny_model_dir, receive_idle_s=3600.0)
    idle = HFEngine(tiny_model_dir, receive_idle_s=0.0)
    await engine.start()
    await idle.start()
    state = {n: t.detach().clone() for n, t in engine._state.items()}
    addresses = []
    original = engine._apply_swap

    def recording_swap(swap):
        addresses.append(sorted(t.data_ptr() for t in swap.tensors.values()))
        original(swap)

    engine._apply_swap = recording_swap
    try:
        with WeightPublisher() as publisher:
            for version in (1, 2):
                publisher.publish(version, state)
                await engine.load_weights(version, publisher.address)
            await idle.load_weights(2, publisher.address)
        assert engine.loaded_version == 2 and engine.receive_buffer.allocations == 1
        assert len(addresses) == 2 and addresses[0] == addresses[1]
        assert engine.receive_buffer.nbytes > 0  # kept for the next version
        await async_wait_until(lambda: idle.receive_buffer.nbytes == 0, 30.0, "the idle engine's buffer released")
    finally:
        await engine.shutdown()
        await idle.shutdown()
