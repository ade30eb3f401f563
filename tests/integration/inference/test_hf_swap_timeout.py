"""A swap the hf engine's worker has already taken when its load times out (a replica SIGSTOPped mid-push and
resumed past the timeout: CI, tests/integration/up/test_replica_faults.py) finishes, and the engine keeps serving.

Before: the timeout cancelled the swap's future while the worker was copying it in; the worker then set the result
of a cancelled future, died (InvalidStateError), and the replica never came back in rotation."""

from __future__ import annotations

import asyncio
import threading

import pytest

import fleetrl.weights
from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.weights import WeightPublisher

pytestmark = pytest.mark.integration


async def test_a_load_that_times_out_after_the_worker_took_the_swap_finishes_it(tiny_model_dir, monkeypatch):
    engine = HFEngine(tiny_model_dir, max_num_seqs=4)
    await engine.start()
    publisher = WeightPublisher()
    try:
        taken, release, timed_out = threading.Event(), threading.Event(), threading.Event()
        real_apply = engine._apply_swap

        def held_apply(swap):  # the worker has taken the swap; it copies it in only when released
            taken.set()
            release.wait(60)
            real_apply(swap)

        real_wait_for = asyncio.wait_for

        async def recording_wait_for(aw, timeout):
            try:
                return await real_wait_for(aw, timeout)
            except TimeoutError:
                timed_out.set()
                raise

        monkeypatch.setattr(engine, "_apply_swap", held_apply)
        monkeypatch.setattr(fleetrl.weights, "transfer_timeout_s", lambda timeout_s, nbytes: 0.05)
        monkeypatch.setattr(asyncio, "wait_for", recording_wait_for)

        publisher.publish(1, {n: t.detach().clone() for n, t in engine._state.items()})
        load = asyncio.ensure_future(engine.load_weights(1, publisher.address))
        assert await asyncio.to_thread(taken.wait, 60)
        assert await asyncio.to_thread(timed_out.wait, 60)  # the load's wait for the swap ran out meanwhile
        release.set()
        result = await real_wait_for(load, 60)
        assert result.version == 1 and engine.loaded_version == 1
        monkeypatch.setattr(asyncio, "wait_for", real_wait_for)
        completions = await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4, ignore_eos=True))
        assert completions[0].versions == [1, 1, 1, 1]
    finally:
        release.set()
        publisher.close()
        await engine.shutdown()


async def test_a_load_cancelled_after_the_worker_took_the_swap_leaves_a_serving_engine(tiny_model_dir, monkeypatch):
    """The caller goes away (a cancelled RPC) while the swap waits for the worker: the swap is withdrawn whole (the
    old weights stay), the worker lives on, and the next load works (before, the worker finished the cancelled swap's
    future and died)."""
    engine = HFEngine(tiny_model_dir, max_num_seqs=4)
    await engine.start()
    publisher = WeightPublisher()
    try:
        taken, release = threading.Event(), threading.Event()
        real_apply = engine._apply_swap
        applied = threading.Event()

        def held_apply(swap):
            taken.set()
            release.wait(60)
            real_apply(swap)
            applied.set()

        monkeypatch.setattr(engine, "_apply_swap", held_apply)
        publisher.publish(1, {n: t.detach().clone() for n, t in engine._state.items()})
        load = asyncio.ensure_future(engine.load_weights(1, publisher.address))
        assert await asyncio.to_thread(taken.wait, 60)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        release.set()
        assert await asyncio.to_thread(applied.wait, 60)
        assert engine.loaded_version == 0
        completions = await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4, ignore_eos=True))
        assert completions[0].versions == [0, 0, 0, 0]
        monkeypatch.setattr(engine, "_apply_swap", real_apply)
        publisher.publish(2, {n: t.detach().clone() for n, t in engine._state.items()})
        assert (await engine.load_weights(2, publisher.address)).version == 2
        completions = await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4, ignore_eos=True))
        assert completions[0].versions == [2, 2, 2, 2]
    finally:
        release.set()
        publisher.close()
        await engine.shutdown()
