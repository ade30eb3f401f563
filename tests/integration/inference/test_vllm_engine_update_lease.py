"""A vLLM replica whose trainer stops calling midway through an engine-group update (issue 39 item 3: the trainer
dies between start_engine_update and finish_engine_update) does not stay paused with its load lock held: after
`engine_update_lease_s` it ends the update itself and serves again, the version it served before when nothing was
received, the version received (exactly, labelled so) when the trainer died after sending it; the trainer's late
calls get a clear error and the next update goes through. Before, requests waited for good and so did every later
load (the lock was never released)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("vllm")

from fleetrl.services.inference.engine import EngineError
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
    perturb_in_place,
    stream_loader,
)

pytestmark = VLLM_TEST_MARKS

LEASE_S = 2.0
WAIT_S = 90.0  # a request sent while paused completes once the lease ends the update: far longer is a failure


@pytest.fixture
def short_lease(vllm_engine: Any) -> Any:
    before = vllm_engine.engine_update_lease_s
    vllm_engine.engine_update_lease_s = LEASE_S
    yield vllm_engine
    vllm_engine.engine_update_lease_s = before


async def test_an_update_abandoned_after_start_resumes_serving_the_same_version(short_lease):
    engine = short_lease
    version = engine.loaded_version
    before = await engine.generate(REQUEST)
    await engine.start_engine_update()  # the trainer then dies: no engine_update, no finish_engine_update
    after = await asyncio.wait_for(engine.generate(REQUEST), WAIT_S)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]  # the weights put back as they were
    assert all(c.versions == [version] * len(c.token_ids) for c in after)
    assert engine.loaded_version == version
    with pytest.raises(EngineError, match="engine_update_lease_s"):
        await engine.finish_engine_update(version + 1)  # the dead trainer's late call
    assert engine.loaded_version == version
    # The load lock was released: the next update starts and finishes.
    await asyncio.wait_for(engine.start_engine_update(), 30)
    await engine.finish_engine_update(version)
    assert [c.token_ids for c in await engine.generate(REQUEST)] == [c.token_ids for c in before]


class _DiesBeforeFinish:
    """The trainer's client to a replica, the trainer dying after the version was sent: finish is never called."""

    def __init__(self, inner: LocalEngineClient) -> None:
        self.inner = inner

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


async def test_an_update_abandoned_after_the_version_arrived_serves_it_exactly(short_lease, tiny_model_dir):
    engine = short_lease
    original = conformance.load_reference(tiny_model_dir).state_dict()
    state = {k: v.clone() for k, v in original.items()}
    loop = asyncio.get_running_loop()
    with WeightPublisher() as publisher:
        transport = GlooEngineTransport(
            {"r0": _DiesBeforeFinish(LocalEngineClient(engine, loop, timeout_s=TIMEOUT_S))},
            ShardedWeights(state),
            stream_loader({"r0": engine}, loop, publisher),
            bucket_bytes=BUCKET_BYTES,
            timeout_s=TIMEOUT_S,
        )
        sync = EngineSync(transport)
        sync.join(ReplicaInfo("r0"))
        try:
            perturb_in_place(state, 43)
            version = engine.loaded_version + 1
            await asyncio.to_thread(sync.push, version)
            completions = await asyncio.wait_for(engine.generate(REQUEST), WAIT_S)
            assert engine.loaded_version == version
            assert all(c.versions == [version] * len(c.token_ids) for c in completions)
            conformance.assert_logprobs_match(conformance.load_reference(tiny_model_dir, state), REQUEST, completions)
            with pytest.raises(EngineError, match="engine_update_lease_s"):
                await engine.finish_engine_update(version)
        finally:
            sync.close()
            await conformance._restore(engine, publisher, original)
