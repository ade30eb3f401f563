"""Truncated importance sampling (TIS) and IcePop: correcting for the sampler/trainer mismatch.

The sampler (vLLM) and the trainer compute slightly different probabilities for the same policy, so
tokens are drawn from inf (rollout_logprobs) while the loss is built on old (trainer logprobs at the
start of the batch). TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training") reweights each token by w = min(exp(old - inf), cap):
- `token` level: one weight per token;
- `sequence` level: w_i = min(exp(masked mean_t of (old - inf)), cap), shared by the sequence's tokens;
- `off`: w = 1.
IcePop (Ling Team 2025, Ring-1T, arXiv:2510.18855) instead discards tokens whose mismatch is too
large: with threshold t > 1, a token whose exp(old - inf) lies outside [1/t, t] gets w = 0. It acts
per token at any level, on top of the TIS weight.

Weights are computed from masked positions only and are exactly 1 at masked-out positions, whatever
those positions hold. They are constants (no gradient).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fleetrl.losses.aggregation import masked_mean
from fleetrl.losses.settings import LOG_RATIO_CLAMP, TIS_LEVELS


@dataclasses.dataclass(frozen=True)
class TisWeights:
    """The weights and which masked tokens were truncated or dropped (all detached, [B, T])."""

    weights_BT: torch.Tensor
    capped_BT: torch.Tensor
    """bool: masked tokens whose (token or sequence) weight exceeded the cap and was truncated."""
    icepop_dropped_BT: torch.Tensor
    """bool: masked tokens given weight 0 by IcePop."""


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    cap: float = 5.0,
    icepop_threshold: float | None = None,
) -> TisWeights:
    """TIS weights [B, T] of `old_logprobs` vs `rollout_logprobs` over `mask` (0/1, [B, T])."""
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown tis_level {level!r}; supported: {', '.join(TIS_LEVELS)}")
    if icepop_threshold is not None and icepop_threshold <= 1:
        raise ValueError(f"icepop_threshold must be > 1, got {icepop_threshold!r}")
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap!r}")
    keep = mask > 0
    # torch.where, not a product: padding may hold anything (even nan) and must not leak in.
    log_w_BT = torch.where(keep, (old_logprobs - rollout_logprobs).detach(), 0.0)
    log_w_BT = log_w_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "token":
        raw_BT = torch.exp(log_w_BT)
    elif level == "sequence":
        log_w_B = masked_mean(log_w_BT, keep.to(log_w_BT.dtype), dim=-1)
        raw_BT = torch.exp(log_w_B.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1)
        raw_BT = raw_BT.expand_as(log_w_BT)
    else:
        raw_BT = torch.ones_like(log_w_BT)
    capped_BT = (raw_BT > cap) & keep
    weights_BT = torch.where(keep, raw_BT.clamp(max=cap), 1.0)
    if icepop_threshold is not None:
        dropped_BT = (log_w_BT.abs() > math.log(icepop_threshold)) & keep
        weights_BT = torch.where(dropped_BT, 0.0, weights_BT)
    else:
        dropped_BT = torch.zeros_like(keep)
    return TisWeights(weights_BT=weights_BT, capped_BT=capped_BT, icepop_dropped_BT=dropped_BT)
