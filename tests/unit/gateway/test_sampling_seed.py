"""Sampling seeds derived from (run seed, row, version, sample index, call index): stable, distinct, scoped."""

from __future__ import annotations

import asyncio

from fleetrl.gateway.sampling_seed import (
    SEED_BITS,
    RolloutKey,
    derive_seed,
    next_rollout_seed,
    rollout_seed_scope,
)


def test_the_seed_is_a_pure_function_of_its_arguments():
    # Pinned: a changed derivation silently changes what every seeded run samples, so it must be deliberate.
    assert derive_seed(0, 0, 0, 0, 0) == 2356574576713486823
    assert derive_seed(7, 123, 4, 2, 1) == derive_seed(7, 123, 4, 2, 1)
    seeds = {
        derive_seed(s, r, v, i, c) for s in (0, 1) for r in (0, 1, 24) for v in (0, 1) for i in range(4) for c in (0, 1)
    }
    assert len(seeds) == 2 * 3 * 2 * 4 * 2  # each component changes the seed
    # Room for the engines' rule that completion i of an n-sample request uses seed + i (< 2**63).
    assert all(0 <= s < 2**SEED_BITS for s in seeds) and 2**SEED_BITS + 1024 < 2**63


def test_outside_a_rollout_there_is_no_seed():
    assert next_rollout_seed() is None


def test_a_scope_counts_its_calls_and_ends_with_its_block():
    key = RolloutKey(run_seed=3, row_id=17, version=2, sample_index=1)
    with rollout_seed_scope(key):
        first, second = next_rollout_seed(), next_rollout_seed()
    assert (first, second) == (derive_seed(3, 17, 2, 1, 0), derive_seed(3, 17, 2, 1, 1))
    assert next_rollout_seed() is None
    with rollout_seed_scope(key):  # a new scope (a retried rollout) starts again from call 0
        assert next_rollout_seed() == first


async def test_concurrent_rollouts_keep_their_own_scopes():
    async def rollout(sample_index: int) -> list[int | None]:
        with rollout_seed_scope(RolloutKey(0, 5, 0, sample_index)):
            out = [next_rollout_seed()]
            await asyncio.sleep(0)  # let the other rollouts run in between
            # A task the rollout starts (e.g. two tool calls gathered) draws from the same counter.
            out.append(await asyncio.create_task(_seed_later()))
            return out

    results = await asyncio.gather(*(rollout(i) for i in range(3)))
    assert results == [[derive_seed(0, 5, 0, i, 0), derive_seed(0, 5, 0, i, 1)] for i in range(3)]


async def _seed_later() -> int | None:
    await asyncio.sleep(0)
    return next_rollout_seed()
