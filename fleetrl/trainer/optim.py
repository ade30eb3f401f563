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


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Any) -> torch.optim.AdamW:
    """AdamW with the run config's learning rate, betas, eps and decoupled weight decay."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )


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
