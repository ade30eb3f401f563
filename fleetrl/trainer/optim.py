"""The optimizer and its learning-rate schedule: AdamW, linear warmup, then constant / linear / cosine decay.

Steps here are optimizer steps (a batch with `num_minibatches` = k takes k of them), as `lr_warmup_steps`
says in the run config.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int | None, schedule: str, min_ratio: float) -> float:
    """The fraction of the peak LR used by optimizer step `step` (0-based).

    Warmup is linear from 1/warmup_steps to 1 over the first warmup_steps steps (the first step
    already moves the weights). After it, `constant` stays at 1; `linear` and `cosine` decay to
    `min_ratio` at `total_steps` and stay there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in ("linear", "cosine"):
        raise ValueError(f"lr_schedule must be constant, linear or cosine, got {schedule!r}")
    if total_steps is None:
        raise ValueError(f"lr_schedule {schedule!r} needs the run length: set max_steps (or pass total_steps)")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# Devices torch's fused AdamW runs on (torch.optim.optimizer._get_fused_kernels_supported_devices; CPU since torch
# 2.4). AdamW only checks at its first step, so a parameter elsewhere (e.g. still on meta) would fail mid-run.
FUSED_ADAMW_DEVICES = frozenset({"cuda", "cpu", "xpu", "mps", "hpu"})


class LowPrecisionStateAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay) whose moments are stored in `state_dtype`
    (bfloat16) over float32 master weights: 12 bytes a parameter with its gradient (4 + 4 + 2 + 2) instead of 16,
    which is what lets a 70B model's optimizer state fit 32 GPUs. Each step reads the moments into float32, updates
    them there, applies the update to the float32 weights, and stores the moments back rounded to `state_dtype`; the
    second moment's 8 significant bits bound the step size's relative error at about 0.4 %. Works on plain tensors
    and FSDP2's DTensor shards (elementwise ops only)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "state_dtype": state_dtype}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=group["state_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=group["state_dtype"])
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                bias1, bias2 = 1 - beta1**step, 1 - beta2**step
                denom = (exp_avg_sq / bias2).sqrt_().add_(eps)
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(exp_avg.to(p.dtype), denom.to(p.dtype), value=-lr / bias1)
        return loss


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    """AdamW with the run config's learning rate, betas, eps and decoupled weight decay.

    Fused (one kernel for the whole update of every parameter) where torch has a fused AdamW for the parameters'
    device and dtype: CUDA, and CPU in recent torch, plain tensors and FSDP2's DTensor shards alike. Elsewhere the
    multi-tensor (foreach) implementation, which computes the same update. `optimizer_implementation` says which.
    With `optimizer_state_dtype = "bfloat16"` over float32 weights: `LowPrecisionStateAdamW` (bfloat16 moments).
    """
    trainable = [p for p in params if p.requires_grad]
    kwargs = {
        "lr": cfg.learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
        "weight_decay": cfg.weight_decay,
    }
    state_dtype = STATE_DTYPES[getattr(cfg, "optimizer_state_dtype", "float32")]
    if trainable and any(p.dtype != state_dtype for p in trainable) and state_dtype != torch.float32:
        return LowPrecisionStateAdamW(trainable, state_dtype=state_dtype, **kwargs)
    if trainable and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in trainable):
        return torch.optim.AdamW(trainable, fused=True, **kwargs)
    return torch.optim.AdamW(trainable, foreach=True, **kwargs)


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """'fused', 'foreach' or 'for-loop' (with its moments' dtype when they are not the weights'): which AdamW
    implementation `optimizer` steps with."""
    defaults = optimizer.defaults
    if isinstance(optimizer, LowPrecisionStateAdamW):
        return f"for-loop, {str(defaults['state_dtype']).removeprefix('torch.')} moments"
    if defaults.get("fused"):
        return "fused"
    return "foreach" if defaults.get("foreach") else "for-loop"


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Any, total_optimizer_steps: int | None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_multiplier` with the run config's schedule."""
    warmup, schedule, min_ratio = cfg.lr_warmup_steps, cfg.lr_schedule, cfg.lr_min_ratio
    # Fail at start, not at the first step after warmup.
    lr_multiplier(
        warmup,
        warmup_steps=warmup,
        total_steps=total_optimizer_steps,
        schedule=schedule,
        min_ratio=min_ratio,
    )

    def multiplier(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=warmup,
            total_steps=total_optimizer_steps,
            schedule=schedule,
            min_ratio=min_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
