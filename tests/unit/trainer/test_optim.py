"""The LR schedule: linear warmup, then constant / linear / cosine decay to lr_min_ratio."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl import Config
from fleetrl.trainer.optim import build_optimizer, build_scheduler, lr_multiplier


def test_warmup_is_linear_and_the_first_step_already_moves():
    values = [lr_multiplier(s, warmup_steps=4, total_steps=None, schedule="constant", min_ratio=0) for s in range(6)]
    assert values == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_and_cosine_decay_to_the_min_ratio():
    kw = {"warmup_steps": 2, "total_steps": 12, "min_ratio": 0.1}
    assert lr_multiplier(2, schedule="linear", **kw) == 1.0
    assert lr_multiplier(7, schedule="linear", **kw) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_multiplier(12, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(50, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_multiplier(7, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(12, schedule="cosine", **kw) == pytest.approx(0.1)


def test_decay_without_a_run_length_fails_at_build_time_naming_max_steps():
    cfg = Config(base_model="x", lr_schedule="cosine")
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    with pytest.raises(ValueError, match="max_steps"):
        build_scheduler(opt, cfg, None)


def test_optimizer_takes_the_config():
    cfg = Config(base_model="x", learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.1)
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)
