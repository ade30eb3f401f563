"""Finite but huge rewards never poison the weights: advantages cannot overflow, and a step whose loss or gradient
is not finite is skipped (nothing applied), counted, and too many in a row fail the run with a clear message."""

from __future__ import annotations

import copy

import pytest
import torch

from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer import PolicyTrainer, StepError
from fleetrl.trainer.advantages import group_advantages
from tests.unit.trainer.helpers import make_cfg, tiny_groups


@pytest.fixture(scope="module")
def huge_reward_groups(tiny_model_dir: str) -> list[RolloutGroup]:
    groups = tiny_groups(tiny_model_dir, num_groups=2, group_size=4)
    for group in groups:
        for i, sample in enumerate(group.samples):
            sample.reward = 1e308 if i % 2 else -1e308
    return groups


def _params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_standardized_advantages_of_huge_rewards_are_finite_and_scale_free():
    assert group_advantages([1e308, -1e308, 1e308, -1e308]) == pytest.approx(group_advantages([1.0, -1.0, 1.0, -1.0]))
    assert group_advantages([-1e308, -1e308]) == [0.0, 0.0]
    assert all(abs(a) < 3.1e38 for a in group_advantages([1e308, -1e308], mode="center"))


def test_huge_rewards_train_a_finite_step_in_standardize_mode(tiny_model_dir, tmp_path, huge_reward_groups):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path))
    result = trainer.train_step(copy.deepcopy(huge_reward_groups))
    assert torch.isfinite(torch.tensor(result.metrics["train/loss"]))
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    assert result.metrics["train/steps_skipped_nonfinite"] == 0.0


def test_a_non_finite_step_is_skipped_and_too_many_in_a_row_fail(tiny_model_dir, tmp_path, huge_reward_groups):
    # Center mode keeps the reward scale: advantages of 3e38 overflow the loss or the gradient norm.
    cfg = make_cfg(tiny_model_dir, tmp_path, advantage_mode="center", max_nonfinite_steps=2)
    trainer = PolicyTrainer(cfg)
    before = _params(trainer)
    first = trainer.train_step(copy.deepcopy(huge_reward_groups))
    assert first.metrics["train/step_skipped_nonfinite"] == 1.0
    assert first.metrics["train/steps_skipped_nonfinite"] == 1.0
    assert first.version == 1 and "train/loss" not in first.metrics  # the version advances; no NaN in the record
    after = _params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing applied
    assert trainer.state.optimizer_steps == 0
    groups = copy.deepcopy(huge_reward_groups)
    for group in groups:
        group.row_id += 100  # new rows (a row is never trained twice)
    with pytest.raises(StepError, match=r"2 steps in a row had a non-finite loss or gradient.*max_nonfinite_steps"):
        trainer.train_step(groups)
