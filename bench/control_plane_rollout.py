"""A trivial rollout for bench/control_plane.py: no inference call, a fixed 8-token sample, a random reward.

No per-token versions: the controller then takes each group's submit version as its oldest token.
"""

from __future__ import annotations

import random

from fleetrl import RolloutSample, RolloutSetup


def make_rollout_fn(setup: RolloutSetup):
    rng = random.Random(0)

    async def rollout_fn(row: dict) -> RolloutSample:
        return RolloutSample(
            tokens=[1, 2, 3, 4, 5, 6, 7, 8],
            logprobs=[0.0, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5, -0.5],
            loss_mask=[0, 0, 0, 0, 1, 1, 1, 1],
            reward=float(rng.random() < 0.5),
        )

    return rollout_fn
