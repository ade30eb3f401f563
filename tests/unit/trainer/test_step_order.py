"""A step's update does not depend on the order its groups arrived in (a rerun or a resume may differ there)."""

from __future__ import annotations

import pytest
import torch

from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.model import load_causal_lm
from tests.unit.trainer.helpers import make_cfg, tiny_groups


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_groups_in_any_arrival_order_give_the_same_weights(tiny_model_dir, tmp_path, num_minibatches):
    groups = tiny_groups(tiny_model_dir, num_groups=3, group_size=4)
    weights = []
    for i, arrival in enumerate([groups, [groups[2], groups[0], groups[1]]]):
        cfg = make_cfg(tiny_model_dir, tmp_path / str(i), prompt_groups_per_step=3, num_minibatches=num_minibatches)
        trainer = PolicyTrainer(cfg)
        assert sorted(trainer.train_step(arrival, step=1).row_ids) == [g.row_id for g in groups]
        weights.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        trainer.close()
    base = load_causal_lm(tiny_model_dir, trainable=False).state_dict()
    assert any(not torch.equal(weights[0][k], base[k]) for k in base)  # the step did change the weights
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
