"""`policy_loss`: the one function the trainer calls to turn a batch into a scalar loss and metrics.

    loss, metrics = policy_loss(name, logprobs, old_logprobs, rollout_logprobs, advantages, mask,
                                ref_logprobs=None, cfg=None, versions=None)

logprobs / old_logprobs / rollout_logprobs / ref_logprobs are float [B, T] target-aligned tensors,
advantages [B], mask [B, T] in {0, 1}, versions long [B, T] (the policy version of each token) or None.
Only `logprobs` receives gradient; the others are constants. `name` is a built-in loss or the import path of a
custom one (fleetrl.losses.custom; the contract is fleetrl.losses.contract). See docs/losses.md for the formulas.
"""

from __future__ import annotations

import torch

from fleetrl.losses.aggregation import aggregate_loss, masked_mean
from fleetrl.losses.contract import CustomLoss, LossInputs, TokenLoss, takes_over
from fleetrl.losses.custom import load_custom_loss
from fleetrl.losses.distill import distillation_advantages
from fleetrl.losses.settings import LOSS_NAMES, LossSettings, resolve_loss_settings
from fleetrl.losses.tis import TisWeights, tis_weights
from fleetrl.losses.variants import LOSSES, k3_kl, log_ratio


def _check_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    versions: torch.Tensor | None = None,
    mask_values_checked: bool = False,
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
    if versions is not None:
        named["versions"] = versions
    for key, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for key in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "mask", "versions"):
        if key in named and tuple(named[key].shape) != shape:
            raise ValueError(
                f"{key} has shape {tuple(named[key].shape)} but logprobs has shape {shape}; "
                "logprobs, old_logprobs, rollout_logprobs, ref_logprobs, mask and versions must all be [B, T]"
            )
    if versions is not None and versions.is_floating_point():
        raise ValueError(f"versions must be an integer tensor, got {versions.dtype}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}] (one per sample), got shape {tuple(advantages.shape)}")
    for key in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
        if key in named and not named[key].is_floating_point():
            raise ValueError(f"{key} must be a floating-point tensor, got {named[key].dtype}")
    for key, value in named.items():
        if value.device != logprobs.device:
            raise ValueError(f"{key} is on {value.device} but logprobs is on {logprobs.device}")
    if not mask_values_checked and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1")


def loss_function(name: str) -> CustomLoss:
    """The function of the loss `name`: a built-in, or the custom loss its import path names."""
    return LOSSES[name] if name in LOSS_NAMES else load_custom_loss(name)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    cfg: object | None = None,
    versions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss `name` (one of LOSS_NAMES, or a custom loss's import path) aggregated to a scalar, and its
    metrics.

    `cfg` is None, a LossSettings, or any object with LossSettings' attribute names (a value of
    None there means the loss's default). `versions` (long [B, T], the policy version of each token) reaches the
    loss as `LossInputs.versions`. Raises ValueError naming the bad input or setting.
    Metrics (floats, over masked tokens): clip_frac, ppo_kl, ratio_mean, tis_weight_mean,
    tis_clip_frac, icepop_frac, kl_sample_train_v1, kl_sample_train_v2; ref_kl when ref_logprobs is
    given; dual_clip_frac for dapo with a dual clip; a loss's own `extra_BT` keys.
    """
    settings = resolve_loss_settings(name, cfg)
    return compute_policy_loss(
        name,
        loss_function(name),
        settings,
        logprobs,
        old_logprobs,
        rollout_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        versions=versions,
    )


def policy_loss_on_device(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    cfg: object | None = None,
    versions: torch.Tensor | None = None,
    mask_values_checked: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with its metrics as 0-dim tensors on the loss's device (no host sync): the trainer sums a
    minibatch's micro-batches there and reads them once. `mask_values_checked`: the caller checked on the host that
    the mask holds only 0 and 1 (that check here would read the device)."""
    return compute_policy_loss_on_device(
        name,
        loss_function(name),
        resolve_loss_settings(name, cfg),
        logprobs,
        old_logprobs,
        rollout_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        versions=versions,
        mask_values_checked=mask_values_checked,
    )


def _raw_tis(old: torch.Tensor, inf: torch.Tensor, keep: torch.Tensor) -> TisWeights:
    """exp(old - inf) untruncated (1 at masked-out positions): the weights of a loss that takes over TIS."""
    weights = torch.where(keep, torch.exp(log_ratio(old, inf)), 1.0)
    none = torch.zeros_like(keep)
    return TisWeights(weights_BT=weights, capped_BT=none, icepop_dropped_BT=none)


def _check_token_loss(name: str, out: object, shape: tuple[int, ...], aggregated: bool) -> TokenLoss:
    """A custom loss's result checked against the contract, so a mistake is named rather than broadcast."""
    if not isinstance(out, TokenLoss):
        raise ValueError(
            f"policy_loss {name!r} returned a {type(out).__name__}; a loss returns "
            "fleetrl.losses.TokenLoss(loss_BT, ratio_BT=None, clipped_BT=None, extra_BT={})"
        )
    want = () if aggregated else shape
    what = "a 0-dim scalar (it takes over aggregation)" if aggregated else f"[B, T] = {list(shape)}"
    if not isinstance(out.loss_BT, torch.Tensor) or tuple(out.loss_BT.shape) != want:
        got = tuple(out.loss_BT.shape) if isinstance(out.loss_BT, torch.Tensor) else type(out.loss_BT).__name__
        raise ValueError(f"policy_loss {name!r} returned loss_BT of shape {got}; it must be {what}")
    parts = {
        "ratio_BT": out.ratio_BT,
        "clipped_BT": out.clipped_BT,
        **{f"extra_BT[{k!r}]": v for k, v in out.extra_BT.items()},
    }
    for key, value in parts.items():
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"policy_loss {name!r} returned {key} of shape {got}; it must be [B, T] = {list(shape)}")
    return out


def compute_policy_loss(
    name: str,
    fn: CustomLoss,
    settings: LossSettings,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss` with the loss function and its resolved settings given: sanitise the inputs, compute the
    TIS weights, call `fn`, aggregate (unless `fn` takes over aggregation) and build the metrics."""
    loss, on_device = compute_policy_loss_on_device(
        name,
        fn,
        settings,
        logprobs,
        old_logprobs,
        rollout_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        versions=versions,
    )
    values = torch.stack(list(on_device.values())).tolist()
    return loss, dict(zip(on_device, (float(v) for v in values), strict=True))


def compute_policy_loss_on_device(
    name: str,
    fn: CustomLoss,
    settings: LossSettings,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    mask_values_checked: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`compute_policy_loss` with its metrics left on the loss's device (0-dim tensors): no host sync, so a
    trainer can read a whole minibatch's metrics at once."""
    _check_inputs(
        logprobs, old_logprobs, rollout_logprobs, advantages, mask, ref_logprobs, versions, mask_values_checked
    )
    own = takes_over(fn)
    builtin = name in LOSS_NAMES

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
    if "tis" in own:
        tis = _raw_tis(old, inf, keep)
    else:
        tis = tis_weights(old, inf, mask_f, settings.tis_level, settings.tis_cap, settings.icepop_threshold)
    advantages_B1 = advantages.detach().to(dtype).unsqueeze(-1)
    if settings.distill_weight > 0:
        # On-policy distillation mixed with the task (Tinker cookbook's incorporate_kl_penalty, Thinking Machines'
        # "On-Policy Distillation"): the negated per-token reverse KL to the teacher joins the advantage.
        if ref is None:
            raise ValueError(
                f"distill_weight = {settings.distill_weight} needs the teacher's logprobs (ref_logprobs): set "
                "teacher_model so the reference holds the teacher and its logprobs reach the loss"
            )
        mixed_BT = distillation_advantages(ref, old, advantages_B1, settings.distill_weight)
        advantages_B1 = torch.where(keep, mixed_BT, 0.0)
    inputs = LossInputs(
        logprobs=pi,
        old_logprobs=old,
        rollout_logprobs=inf,
        ref_logprobs=ref,
        advantages_B1=advantages_B1,
        mask=mask_f,
        tis_weights=tis.weights_BT,
        versions=None if versions is None else torch.where(keep, versions.detach().long(), -1),
    )
    token_loss = fn(inputs, settings)
    if not builtin:
        token_loss = _check_token_loss(name, token_loss, tuple(pi.shape), "aggregation" in own)
    if "aggregation" in own:
        loss = token_loss.loss_BT
    else:
        loss = aggregate_loss(token_loss.loss_BT, mask_f, settings.loss_agg_mode, settings.loss_agg_constant)

    with torch.no_grad():
        pi_d = pi.detach()
        sample_train_lr = log_ratio(inf, pi_d)
        ratio = token_loss.ratio_BT if token_loss.ratio_BT is not None else torch.exp(log_ratio(pi_d, old))
        clipped = token_loss.clipped_BT if token_loss.clipped_BT is not None else torch.zeros_like(keep)
        stats = {
            "clip_frac": clipped,
            "ppo_kl": log_ratio(old, pi_d),
            "ratio_mean": ratio,
            "tis_weight_mean": tis.weights_BT,
            "tis_clip_frac": tis.capped_BT,
            "icepop_frac": tis.icepop_dropped_BT,
            "kl_sample_train_v1": sample_train_lr,
            "kl_sample_train_v2": 0.5 * sample_train_lr.square(),
        }
        if ref is not None:
            stats["ref_kl"] = k3_kl(pi_d, ref)
        if settings.distill_weight > 0 and ref is not None:
            stats["reverse_kl"] = old - ref  # the single-sample reverse KL(student || teacher) per token
        stats.update(token_loss.extra_BT)
        means = torch.stack([masked_mean(v.detach().to(dtype), mask_f) for v in stats.values()])
    return loss, dict(zip(stats, means.unbind(), strict=True))
