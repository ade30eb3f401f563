"""Masked reductions and `loss_agg_mode`: how a [B, T] per-token loss becomes one scalar.

Modes (L = per-token loss, m = mask, n_i = sum_t m_it, S = sequences with n_i > 0):
- `token-mean` (default; DAPO, Yu et al. 2025, §3.3): sum_it m*L / sum_it m. Every token of the
  batch weighs the same, so long answers are not down-weighted.
- `seq-mean-token-mean` (GRPO as written, Shao et al. 2024, arXiv:2402.03300, eq. 3): mean over S of (sum_t m*L / n_i).
- `seq-mean-token-sum-norm` (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783): mean over S of (sum_t m*L / K) with
  a constant K (`loss_agg_constant`, default T the padded length), removing the length bias.
- `sum`: sum_it m*L (no normalisation; the caller normalises, e.g. across micro-batches).

Sequences with no masked token are left out of the per-sequence means (they have no loss to average);
a batch with no masked token at all gives a loss of 0 that is still connected to the graph.
"""

from __future__ import annotations

import torch

from fleetrl.losses.settings import AGG_MODES


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (`mask` is a float 0/1 tensor of the same shape)."""
    if dim is None:
        return (values * mask).sum()
    return (values * mask).sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over masked positions; 0 where nothing is masked (no division by zero)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def aggregate_loss(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, constant: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar following `mode` (one of AGG_MODES)."""
    if mode == "token-mean":
        return masked_mean(loss_BT, mask_BT)
    if mode == "sum":
        return masked_sum(loss_BT, mask_BT)
    tokens_B = mask_BT.sum(dim=-1)
    has_tokens_B = (tokens_B > 0).to(loss_BT.dtype)
    if mode == "seq-mean-token-mean":
        seq_loss_B = masked_sum(loss_BT, mask_BT, dim=-1) / tokens_B.clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        norm = float(loss_BT.shape[-1]) if constant is None else float(constant)
        seq_loss_B = masked_sum(loss_BT, mask_BT, dim=-1) / norm
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; supported: {', '.join(AGG_MODES)}")
    return masked_mean(seq_loss_B, has_tokens_B)
