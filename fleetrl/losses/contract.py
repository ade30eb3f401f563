"""The loss contract: what a policy loss receives (`LossInputs`) and returns (`TokenLoss`), built-in or custom.

Every built-in loss (fleetrl.losses.variants) and every custom loss a run names by import path
(`policy_loss = "my_pkg.losses:clipped_ratio"`, see fleetrl.losses.custom and docs/losses.md) is a `CustomLoss`:

    def clipped_ratio(x: LossInputs, s: LossSettings) -> TokenLoss: ...

fleetrl computes the inputs (sanitised, TIS weights per `tis_level` / `tis_cap` / `icepop_threshold`), calls the
loss, then aggregates its per-token loss with `loss_agg_mode` and reports its metrics. A loss may take over
aggregation and/or TIS by carrying `takes_over = {"aggregation", "tis"}` (any subset) as an attribute:
- "aggregation": it returns the aggregated scalar in `TokenLoss.loss_BT` (a 0-dim tensor) instead of [B, T].
- "tis": `LossInputs.tis_weights` holds the raw weights exp(old - inf) (log-ratio clamped to [-20, 20], 1 at
  masked-out positions; no cap, no IcePop, whatever tis_level says) for the loss to truncate as it likes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

from fleetrl.losses.settings import LossSettings

TAKES_OVER: frozenset[str] = frozenset({"aggregation", "tis"})
"""What a loss may take over from fleetrl through its `takes_over` attribute."""


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """Sanitised per-token inputs of a loss: float [B, T] target-aligned tensors except `advantages_B1` ([B, 1])
    and `versions` (long [B, T] or None).

    Masked-out positions hold 0 in every float tensor (whatever the padding held, nan included) and -1 in
    `versions`; everything but `logprobs` is detached. Float tensors are float32 (float64 when the logprobs are).
    """

    logprobs: torch.Tensor
    """pi: the trainer's current logprobs of the target tokens; the only tensor that carries gradient."""
    old_logprobs: torch.Tensor
    """old: the policy's logprobs at the start of the batch (the PPO inner loop's behaviour policy)."""
    rollout_logprobs: torch.Tensor
    """inf: the logprobs the sampler (inference replica) reported when it drew each token."""
    ref_logprobs: torch.Tensor | None
    """ref: the frozen reference model's logprobs (the distillation teacher's when the run sets teacher_model);
    None unless kl_beta > 0 or teacher_model is set."""
    advantages_B1: torch.Tensor
    """A: one advantage per sample, [B, 1] so it broadcasts over tokens; per token, [B, T], when the run distils
    (distill_weight > 0: (1 - w) * A + w * (ref - old), 0 at masked-out positions). Elementwise use covers both."""
    mask: torch.Tensor
    """1.0 on the tokens that train (the sample's loss_mask after the shift), 0.0 elsewhere."""
    tis_weights: torch.Tensor
    """w: fleetrl's truncated importance-sampling weights (fleetrl.losses.tis; 1 where tis_level = "off"), or the
    raw exp(old - inf) when the loss takes over "tis". Built-ins multiply their policy-gradient term by it."""
    versions: torch.Tensor | None = None
    """The policy version that sampled each token (long [B, T]; -1 where unknown or masked out); None when no
    sample of the batch carries versions."""


@dataclasses.dataclass(frozen=True)
class TokenLoss:
    """What a loss returns: its loss and the detached per-token quantities its metrics are built from."""

    loss_BT: torch.Tensor
    """The per-token loss [B, T] (fleetrl masks and aggregates it); a 0-dim scalar when the loss takes over
    "aggregation". Must be connected to `LossInputs.logprobs` for a gradient to flow."""
    ratio_BT: torch.Tensor | None = None
    """The importance ratio the loss used (r per token; gspo: the sequence ratio s), reported as `ratio_mean`.
    None: fleetrl reports exp(pi - old)."""
    clipped_BT: torch.Tensor | None = None
    """bool: tokens where a clip is in effect (their surrogate gradient is cut), reported as `clip_frac`.
    None: no clip (clip_frac 0)."""
    extra_BT: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Further per-token quantities [B, T], each reported as its masked mean under its key (`train/<key>` in
    metrics.jsonl unless the key holds a '/')."""


@runtime_checkable
class CustomLoss(Protocol):
    """A policy loss: `loss(inputs, settings) -> TokenLoss`. `settings` is the run's LossSettings (eps_clip,
    eps_clip_high, kl_beta, ... with None clip values filled as 0.2). An optional attribute
    `takes_over: set[str]` (a subset of TAKES_OVER) hands aggregation and/or TIS to the loss."""

    def __call__(self, inputs: LossInputs, settings: LossSettings, /) -> TokenLoss: ...


def takes_over(loss: object) -> frozenset[str]:
    """The parts a loss takes over from fleetrl (its `takes_over` attribute, validated); empty by default."""
    value = getattr(loss, "takes_over", None)
    if value is None:
        return frozenset()
    if not isinstance(value, set | frozenset | list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"takes_over must be a set of strings from {sorted(TAKES_OVER)}, got {value!r}")
    unknown = sorted(set(value) - TAKES_OVER)
    if unknown:
        raise ValueError(f"takes_over has {unknown}: a loss may take over only {sorted(TAKES_OVER)}")
    return frozenset(value)
