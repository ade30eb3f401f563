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


def _one_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.01 * (i + 1)) + 0.001 * torch.arange(p.numel(), dtype=p.dtype).view_as(p)
    optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_is_fused_where_torch_has_it_and_steps_as_the_plain_one(dtype):
    from fleetrl.trainer.optim import optimizer_implementation

    cfg = Config(base_model="x", learning_rate=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    start = [torch.randn(8, 16, dtype=dtype), torch.randn(16, dtype=dtype)]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    plain_params = [torch.nn.Parameter(t.clone()) for t in start]
    fused = build_optimizer(fused_params, cfg)
    assert optimizer_implementation(fused) == "fused"  # torch >= 2.4 has a fused AdamW for CPU, float32 and bf16
    plain = torch.optim.AdamW(
        plain_params, lr=1e-3, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=0.1, foreach=False
    )
    for _ in range(3):
        ours, theirs = _one_step(fused_params, fused), _one_step(plain_params, plain)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 weights round to 8 bits; the two differ by at most one ulp
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=0)


def test_adamw_falls_back_to_foreach_where_no_fused_kernel_exists():
    from fleetrl.trainer.optim import optimizer_implementation

    params = [torch.nn.Parameter(torch.empty(4, device="meta"))]  # no fused AdamW for the meta device
    optimizer = build_optimizer(params, Config(base_model="x"))
    assert optimizer_implementation(optimizer) == "foreach"


def test_bfloat16_moments_step_like_adamw_over_float32_weights():
    """LowPrecisionStateAdamW keeps its moments in bfloat16 (12 bytes a parameter with weights and gradients) and
    moves float32 weights as torch's AdamW does, up to the moments' rounding."""
    from fleetrl.trainer.optim import LowPrecisionStateAdamW, optimizer_implementation

    torch.manual_seed(0)
    start = torch.randn(4096)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours = LowPrecisionStateAdamW([ours], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW([theirs], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(20):
        grad = torch.randn(4096)
        for p, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            p.grad = grad.clone()
            opt.step()
    state = opt_ours.state[ours]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and ours.dtype == torch.float32
    ours_update, theirs_update = ours.detach() - start, theirs.detach() - start
    assert torch.nn.functional.cosine_similarity(ours_update, theirs_update, dim=0) > 0.999
    assert (ours_update - theirs_update).norm() / theirs_update.norm() < 0.02
    assert optimizer_implementation(opt_ours) == "for-loop, bfloat16 moments"


def test_the_config_picks_bfloat16_moments_only_over_wider_weights():
    from fleetrl.trainer.optim import LowPrecisionStateAdamW

    fp32 = [torch.nn.Parameter(torch.zeros(2))]
    bf16 = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert isinstance(
        build_optimizer(fp32, Config(base_model="x", optimizer_state_dtype="bfloat16")), LowPrecisionStateAdamW
    )
    assert type(build_optimizer(fp32, Config(base_model="x"))) is torch.optim.AdamW
    # pure bf16 weights: the moments are bf16 anyway, torch's fused AdamW does it
    assert type(build_optimizer(bf16, Config(base_model="x", optimizer_state_dtype="bfloat16"))) is torch.optim.AdamW
