"""A version's engine-group update that another replica refuses to start (dead, or not answering) ends at once on
the replica where it did start: nothing was sent, so the trainer's engine (fleetrl.weights.vllm_gloo) aborts it
there (FinishEngineUpdate with abort), and that replica serves on and can load the version over the weight stream
right away instead of staying paused, holding its load lock, for engine_update_lease_s (120 s)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from fleetrl.services.inference.vllm_transfer import LocalEngineClient
from fleetrl.weights import WeightPublisher
from fleetrl.weights.engine_sync import ReplicaInfo
from fleetrl.weights.gather import ShardedWeights
from fleetrl.weights.vllm_gloo import EngineTransferFailed, FanoutClient, GlooEngineTransport
from tests.integration.inference import conformance
from tests.integration.inference.conftest import VLLM_TEST_MARKS
from tests.integration.inference.engine_group import BUCKET_BYTES, REQUEST, TIMEOUT_S, perturb_in_place

pytestmark = VLLM_TEST_MARKS


class RefusingClient:
    """A replica whose every engine call fails, as a dead one's would."""

    def _refuse(self, *args: object) -> None:
        raise RuntimeError("connection refused")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse
    abort_weight_update = _refuse


async def test_an_update_refused_by_another_replica_is_ended_at_once_where_it_started(vllm_engine, tiny_model_dir):
    original = conformance.load_reference(tiny_model_dir).state_dict()
    state = {k: v.clone() for k, v in original.items()}
    loop = asyncio.get_running_loop()
    local = LocalEngineClient(vllm_engine, loop, timeout_s=TIMEOUT_S)
    served = vllm_engine.loaded_version
    with WeightPublisher() as publisher:
        transport = GlooEngineTransport(
            {"vllm": local}, ShardedWeights(state), None, bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S
        )
        try:
            await asyncio.to_thread(transport.build, [ReplicaInfo("vllm")], {"vllm": 1}, 2)
            assert transport.engine is not None
            # The next version's group also names a replica that refuses every call (it died after the build).
            transport.engine.client = FanoutClient(
                {"vllm": local, "dead": RefusingClient()}, {"vllm": 1, "dead": 2}, TIMEOUT_S
            )
            perturb_in_place(state, 61)
            version = served + 1
            with pytest.raises(EngineTransferFailed, match="connection refused") as failed:
                await asyncio.to_thread(transport.send, version)
            assert failed.value.served == []
            # The update that started on the vLLM replica is over: not paused, its load lock free, still serving
            # the version it served (nothing was relabelled).
            assert vllm_engine._engine_update is None and not vllm_engine._load_lock.locked()
            assert vllm_engine.loaded_version == served
            completions = await vllm_engine.generate(REQUEST)
            assert all(v == served for c in completions for v in c.versions)
            # ... and it loads the version over the stream at once.
            publisher.publish(version, state)
            await vllm_engine.load_weights(version, publisher.address, timeout_s=TIMEOUT_S)
            assert vllm_engine.loaded_version == version
            reference = conformance.load_reference(tiny_model_dir, state)
            conformance.assert_logprobs_match(reference, REQUEST, await vllm_engine.generate(REQUEST))
        finally:
            transport.teardown()
            await conformance._restore(vllm_engine, publisher, original)
