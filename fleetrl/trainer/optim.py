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


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Any) -> torch.optim.AdamW:
    """AdamW with the run config's learning rate, betas, eps and decoupled weight decay.

    Fused (one kernel for the whole update of every parameter) where torch has a fused AdamW for the parameters'
    device and dtype: CUDA, and CPU in recent torch, plain tensors and FSDP2's DTensor shards alike. Elsewhere the
    multi-tensor (foreach) implementation, which computes the same update. `optimizer_implementation` says which.
    """
    trainable = [p for p in params if p.requires_grad]
    kwargs = {
        "lr": cfg.learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_eps,
        "weight_decay": cfg.weight_decay,
    }
    if trainable and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in trainable):
        return torch.optim.AdamW(trainable, fused=True, **kwargs)
    return torch.optim.AdamW(trainable, foreach=True, **kwargs)


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """'fused', 'foreach' or 'for-loop': which AdamW implementation `optimizer` steps with."""
    defaults = optimizer.defaults
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
