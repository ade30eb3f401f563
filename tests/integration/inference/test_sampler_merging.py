"""The sampler's merging of a row's seeded n = 1 calls (fleetrl/gateway/sampler_coalesce.py) against a real hf replica
over gRPC: 8 concurrent calls reach the engine as one request, and every caller gets exactly the completion it gets
when the calls go out one by one (issue 19: one prefill and one gRPC call per row instead of G)."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.gateway.sampler import Sampler
from fleetrl.gateway.sampling_seed import RolloutKey, rollout_seed_scope
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.server import create_server, make_engine

pytestmark = pytest.mark.integration


async def sample_row(sampler: Sampler, seeded_by_rollout: bool) -> list[tuple[list[int], list[float]]]:
    async def one(i: int):
        if seeded_by_rollout:  # as a gateway runs a rollout: the seed comes from the rollout's key
            with rollout_seed_scope(RolloutKey(7, 3, 0, i)):
                (c,) = await sampler.sample_with_prompt_tokens([5, 6, 7], n=1, max_tokens=8, temperature=1.0)
        else:
            (c,) = await sampler.sample_with_prompt_tokens([5, 6, 7], n=1, max_tokens=8, seed=1000 + i)
        return c.completion_tokens, c.inference_logprobs

    return list(await asyncio.gather(*(one(i) for i in range(8))))


@pytest.mark.parametrize("seeded_by_rollout", [False, True])
async def test_a_rows_calls_are_one_request_with_the_same_completions(tiny_model_dir, seeded_by_rollout):
    config = InferenceConfig(model=tiny_model_dir, engine="hf", grpc_port=0, http_port=None, metrics_port=None)
    engine = make_engine(config)
    service = create_server(config, engine)
    await service.start()
    merging, one_by_one = Sampler(), Sampler(coalesce=False)
    try:
        for sampler in (merging, one_by_one):
            sampler.set_replicas([f"127.0.0.1:{service.grpc_port}"])
        before = engine.stats().requests
        merged = await sample_row(merging, seeded_by_rollout)
        assert engine.stats().requests - before == 1
        before = engine.stats().requests
        alone = await sample_row(one_by_one, seeded_by_rollout)
        assert engine.stats().requests - before == 8
    finally:
        await merging.close()
        await one_by_one.close()
        await service.stop()
    assert [tokens for tokens, _ in merged] == [tokens for tokens, _ in alone]
    for (_, a), (_, b) in zip(merged, alone, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    assert len({tuple(tokens) for tokens, _ in merged}) > 1  # 8 seeds, not one completion 8 times
