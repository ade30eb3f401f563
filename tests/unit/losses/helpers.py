"""Helpers shared by the loss tests: run a loss on float64 tensors and read back loss, grad, metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fleetrl.losses import LossSettings, policy_loss


@dataclass
class LossRun:
    loss: torch.Tensor
    grad: torch.Tensor
    metrics: dict[str, float]


def t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    """A float64 tensor (exact enough for hand-computed expectations)."""
    return torch.tensor(rows, dtype=torch.float64)


def run_loss(
    name: str,
    pi: torch.Tensor,
    old: torch.Tensor,
    inf: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    ref: torch.Tensor | None = None,
    **settings: object,
) -> LossRun:
    """policy_loss on a fresh leaf copy of `pi`; returns the loss, d loss / d pi and the metrics."""
    logprobs = pi.clone().requires_grad_(True)
    loss, metrics = policy_loss(name, logprobs, old, inf, adv, mask, ref_logprobs=ref, cfg=LossSettings(**settings))
    loss.backward()
    assert logprobs.grad is not None
    return LossRun(loss.detach(), logprobs.grad, metrics)


def from_ratios(old: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    """pi such that exp(pi - old) equals `ratios`."""
    return old + torch.log(t(ratios))


LN2 = math.log(2.0)
