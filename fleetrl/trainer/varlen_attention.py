"""Variable-length attention for packed rows: each sample attends causally to itself only, at the cost of its own
length squared.

transformers finds the samples of a packed row from its position ids. With flash-attention 2 it runs the
variable-length kernel (`flash_attn_varlen_func`): the trainer uses it on CUDA when the `flash_attn` package is
installed. Without it, sdpa and eager build a block-diagonal [N, N] mask and compute attention over the whole row:
(sum of lengths)^2 instead of the sum of the squares (on a 4096-token sample packed with a few hundred short ones,
several times the work, and an N x N mask in memory). `varlen_sdpa` is the fallback that computes only what is
needed: it splits the row at each position id 0 and runs `scaled_dot_product_attention(is_causal=True)` per sample
(torch's flash or memory-efficient kernel on CUDA, its fused CPU kernel on CPU), with no mask at all. A batch that
is not one packed row (padded rows, or a mask given) goes to transformers' own sdpa unchanged.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

VARLEN_SDPA = "fleetrl_varlen_sdpa"


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query/key/value `[B, heads, T, D]` in, `[B, T, heads, D]` out."""
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or query.shape[2] == 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    length = query.shape[2]
    starts = torch.nonzero(position_ids.reshape(-1)[:length] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = [*starts, length]
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            is_causal=True,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa)


def packed_attention(device: torch.device) -> str:
    """The attention implementation for packed rows on `device`: flash-attention 2 on CUDA where installed, else
    `varlen_sdpa`."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_SDPA


def use_packed_attention(model: torch.nn.Module, device: torch.device) -> str:
    """Switch `model` (an HF model, or a PEFT / FSDP-wrapped one) to variable-length attention for packed rows;
    returns the implementation's name. A model whose attention does not follow transformers' AttentionInterface
    keeps its own (with sdpa or eager, transformers still masks packed rows correctly, only at full cost)."""
    _register()
    name = packed_attention(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    setter = getattr(base, "set_attn_implementation", None)
    if setter is None:
        return str(getattr(getattr(base, "config", None), "_attn_implementation", "unknown"))
    try:
        setter(name)
    except (ValueError, ImportError) as exc:
        kept = base.config._attn_implementation
        logger.warning("packed attention: %s is not usable here (%s); keeping %s", name, exc, kept)
    return str(base.config._attn_implementation)
