"""A swap the hf engine's worker has already taken when its load times out (a replica SIGSTOPped mid-push and
resumed past the timeout: CI, tests/integration/up/test_replica_faults.py) finishes, and the engine keeps serving;
a load whose caller goes away withdraws its swap.

Before: the timeout (or the cancellation) cancelled the swap's future while the worker was copying it in; the worker
then set the result of a cancelled future, died (InvalidStateError), and the replica never came back in rotation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

import fleetrl.weights
from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.weights import WeightPublisher

pytestmark = pytest.mark.integration


class HeldSwap:
    """Holds the engine's worker between taking a swap and copying it in, until released."""

    def __init__(self, engine: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken, self.release, self.applied = threading.Event(), threading.Event(), threading.Event()
        self.real_apply = engine._apply_swap
        monkeypatch.setattr(engine, "_apply_swap", self._held)

    def _held(self, swap) -> None:
        self.taken.set()
        self.release.wait(60)
        self.real_apply(swap)
        self.applied.set()


@pytest_asyncio.fixture
async def engine_and_publisher(tiny_model_dir) -> AsyncIterator[tuple[HFEngine, WeightPublisher]]:
    engine = HFEngine(tiny_model_dir, max_num_seqs=4)
    await engine.start()
    publisher = WeightPublisher()
    try:
        yield engine, publisher
    finally:
        publisher.close()
        await engine.shutdown()


async def _versions(engine: HFEngine) -> list[int]:
    completions = await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4, ignore_eos=True))
    return completions[0].versions


async def test_a_load_that_times_out_after_the_worker_took_the_swap_finishes_it(engine_and_publisher, monkeypatch):
    engine, publisher = engine_and_publisher
    held = HeldSwap(engine, monkeypatch)
    timed_out = threading.Event()
    real_wait_for = asyncio.wait_for

    async def recording_wait_for(aw, timeout):
        try:
            return await real_wait_for(aw, timeout)
        except TimeoutError:
            timed_out.set()
            raise

    monkeypatch.setattr(fleetrl.weights, "transfer_timeout_s", lambda timeout_s, nbytes: 0.05)
    monkeypatch.setattr(asyncio, "wait_for", recording_wait_for)
    try:
        publisher.publish(1, {n: t.detach().clone() for n, t in engine._state.items()})
        load = asyncio.ensure_future(engine.load_weights(1, publisher.address))
        assert await asyncio.to_thread(held.taken.wait, 60)
        assert await asyncio.to_thread(timed_out.wait, 60)  # the load's wait for the swap ran out meanwhile
        held.release.set()
        result = await real_wait_for(load, 60)
    finally:
        held.release.set()
        monkeypatch.setattr(asyncio, "wait_for", real_wait_for)
    assert result.version == 1 and engine.loaded_version == 1
    assert await _versions(engine) == [1, 1, 1, 1]


async def test_a_load_cancelled_after_the_worker_took_the_swap_leaves_a_serving_engine(
    engine_and_publisher, monkeypatch
):
    """The caller goes away (a cancelled RPC) while the swap waits for the worker: the swap is withdrawn whole (the
    old weights stay), the worker lives on, and the next load works."""
    engine, publisher = engine_and_publisher
    held = HeldSwap(engine, monkeypatch)
    try:
        publisher.publish(1, {n: t.detach().clone() for n, t in engine._state.items()})
        load = asyncio.ensure_future(engine.load_weights(1, publisher.address))
        assert await asyncio.to_thread(held.taken.wait, 60)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
    finally:
        held.release.set()
    assert await asyncio.to_thread(held.applied.wait, 60)
    assert engine.loaded_version == 0 and await _versions(engine) == [0, 0, 0, 0]
    monkeypatch.setattr(engine, "_apply_swap", held.real_apply)
    publisher.publish(2, {n: t.detach().clone() for n, t in engine._state.items()})
    assert (await engine.load_weights(2, publisher.address)).version == 2
    assert await _versions(engine) == [2, 2, 2, 2]
