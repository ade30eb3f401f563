"""The Tinker env of env.py as a fleetrl rollout: one row is one EnvGroupBuilder of the RLDataset, its G envs the
group (`fleetrl.tinker`). Loaded by the gateways as `rollout.py:make_rollout_fn` (train.py / run.toml).

rollout_extras: num_batches, groups_per_batch, seed (the RLDataset, rebuilt the same in every gateway), and
tinker_max_turns (episode bound, default 64).
"""

from __future__ import annotations

from env import AdditionDataset

from fleetrl import RolloutSetup
from fleetrl.tinker import builder_from_dataset, tinker_rollout_fn


def make_dataset(tokenizer, extras: dict, group_size: int) -> AdditionDataset:  # type: ignore[no-untyped-def]
    return AdditionDataset(
        tokenizer,
        num_batches=int(extras.get("num_batches", 8)),
        groups_per_batch=int(extras.get("groups_per_batch", 4)),
        group_size=group_size,
        seed=int(extras.get("seed", 0)),
    )


def make_rollout_fn(setup: RolloutSetup):  # type: ignore[no-untyped-def]
    dataset = make_dataset(setup.tokenizer, setup.extras, setup.completions_per_prompt)
    return tinker_rollout_fn(setup, builder_from_dataset(dataset))
