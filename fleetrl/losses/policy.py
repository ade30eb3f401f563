"""`policy_loss`: the one function the trainer calls to turn a batch into a scalar loss and metrics.

    loss, metrics = policy_loss(name, logprobs, old_logprobs, rollout_logprobs, advantages, mask,
                                ref_logprobs=None, cfg=None)

logprobs / old_logprobs / rollout_logprobs / ref_logprobs are float [B, T] target-aligned tensors,
advantages [B], mask [B, T] in {0, 1}. Only `logprobs` receives gradient; the others are constants.
See docs/losses.md for the formulas.
"""

from __future__ import annotations

import torch

from fleetrl.losses.aggregation import aggregate_loss, masked_mean
from fleetrl.losses.settings import resolve_loss_settings
from fleetrl.losses.tis import tis_weights
from fleetrl.losses.variants import LOSSES, LossInputs, k3_kl, log_ratio


def _check_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
) -> None:
    named = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "advantages": advantages,
        "mask": mask,
    }
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for key, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for key in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "mask"):
        if key in named and tuple(named[key].shape) != shape:
            raise ValueError(
                f"{key} has shape {tuple(named[key].shape)} but logprobs has shape {shape}; "
                "logprobs, old_logprobs, rollout_logprobs, ref_logprobs and mask must all be [B, T]"
            )
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}] (one per sample), got shape {tuple(advantages.shape)}")
    for key in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
        if key in named and not named[key].is_floating_point():
            raise ValueError(f"{key} must be a floating-point tensor, got {named[key].dtype}")
    for key, value in named.items():
        if value.device != logprobs.device:
            raise ValueError(f"{key} is on {value.device} but logprobs is on {logprobs.device}")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1")


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    cfg: object | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss `name` (one of LOSS_NAMES) aggregated to a scalar, and its metrics.

    `cfg` is None, a LossSettings, or any object with LossSettings' attribute names (a value of
    None there means the loss's default). Raises ValueError naming the bad input or setting.
    Metrics (floats, over masked tokens): clip_frac, ppo_kl, ratio_mean, tis_weight_mean,
    tis_clip_frac, icepop_frac, kl_sample_train_v1, kl_sample_train_v2; ref_kl when ref_logprobs is
    given; dual_clip_frac for dapo with a dual clip.
    """
    settings = resolve_loss_settings(name, cfg)
    _check_inputs(logprobs, old_logprobs, rollout_logprobs, advantages, mask, ref_logprobs)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask.bool()
    mask_f = keep.to(dtype)

    # Masked-out positions are set to 0 with torch.where (not a product) so whatever padding holds,
    # nan included, reaches neither the loss, the weights nor the gradient.
    def clean(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, t.to(dtype), 0.0)

    pi = clean(logprobs)
    old = clean(old_logprobs.detach())
    inf = clean(rollout_logprobs.detach())
    ref = clean(ref_logprobs.detach()) if ref_logprobs is not None else None
    tis = tis_weights(old, inf, mask_f, settings.tis_level, settings.tis_cap, settings.icepop_threshold)
    inputs = LossInputs(
        logprobs=pi,
        old_logprobs=old,
        rollout_logprobs=inf,
        ref_logprobs=ref,
        advantages_B1=advantages.detach().to(dtype).unsqueeze(-1),
        mask=mask_f,
        tis_weights=tis.weights_BT,
    )
    token_loss = LOSSES[name](inputs, settings)
    loss = aggregate_loss(token_loss.loss_BT, mask_f, settings.loss_agg_mode, settings.loss_agg_constant)

    with torch.no_grad():
        pi_d = pi.detach()
        sample_train_lr = log_ratio(inf, pi_d)
        stats = {
            "clip_frac": token_loss.clipped_BT,
            "ppo_kl": log_ratio(old, pi_d),
            "ratio_mean": token_loss.ratio_BT,
            "tis_weight_mean": tis.weights_BT,
            "tis_clip_frac": tis.capped_BT,
            "icepop_frac": tis.icepop_dropped_BT,
            "kl_sample_train_v1": sample_train_lr,
            "kl_sample_train_v2": 0.5 * sample_train_lr.square(),
        }
        if ref is not None:
            stats["ref_kl"] = k3_kl(pi_d, ref)
        stats.update(token_loss.extra_BT)
        means = torch.stack([masked_mean(v.to(dtype), mask_f) for v in stats.values()])
        metrics = dict(zip(stats, (float(v) for v in means.tolist()), strict=True))
    return loss, metrics
