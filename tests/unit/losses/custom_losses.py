"""Custom losses the tests name by import path (`policy_loss = "tests.unit.losses.custom_losses:grpo_copy"`)."""

from __future__ import annotations

import torch

from fleetrl.losses import LossInputs, LossSettings, TokenLoss, clipped_surrogate, k3_kl, log_ratio, masked_mean


def grpo_copy(x: LossInputs, s: LossSettings) -> TokenLoss:
    """fleetrl.losses.variants._grpo, copied as a user would write it with the public helpers."""
    assert s.eps_clip is not None and s.eps_clip_high is not None
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss, ratio, clipped = clipped_surrogate(lr, x.advantages_B1, s.eps_clip, s.eps_clip_high)
    loss = loss * x.tis_weights
    if x.ref_logprobs is not None and s.kl_beta > 0:
        loss = loss + s.kl_beta * k3_kl(x.logprobs, x.ref_logprobs)
    return TokenLoss(loss, ratio, clipped)


def ppo_token_mean(x: LossInputs, s: LossSettings) -> TokenLoss:
    """ppo with its own token-mean aggregation: returns the scalar, fleetrl aggregates nothing."""
    assert s.eps_clip is not None and s.eps_clip_high is not None
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss, ratio, clipped = clipped_surrogate(lr, x.advantages_B1, s.eps_clip, s.eps_clip_high)
    return TokenLoss(masked_mean(loss * x.tis_weights, x.mask), ratio, clipped)


ppo_token_mean.takes_over = {"aggregation"}  # type: ignore[attr-defined]


def worst_sequence(x: LossInputs, s: LossSettings) -> TokenLoss:
    """An aggregation no loss_agg_mode offers: the largest per-sequence mean of -A * pi."""
    per_seq_B = masked_mean(-x.advantages_B1 * x.logprobs, x.mask, dim=-1)
    return TokenLoss(per_seq_B.max())


worst_sequence.takes_over = {"aggregation"}  # type: ignore[attr-defined]

SEEN: list[LossInputs] = []
"""The inputs `recording` was called with (tests clear it)."""


def recording(x: LossInputs, s: LossSettings) -> TokenLoss:
    """-A * pi per token, remembering its inputs."""
    SEEN.append(x)
    extra = {} if x.versions is None else {"version_mean": x.versions.float()}
    return TokenLoss(-x.advantages_B1 * x.logprobs, extra_BT=extra)


def recording_tis(x: LossInputs, s: LossSettings) -> TokenLoss:
    """`recording` that takes over TIS: it sees the raw weights."""
    return recording(x, s)


recording_tis.takes_over = {"tis"}  # type: ignore[attr-defined]


# --- losses that must fail at start ---

NOT_CALLABLE = 3


def wrong_shape(x: LossInputs, s: LossSettings) -> TokenLoss:
    return TokenLoss((-x.advantages_B1 * x.logprobs).sum(dim=-1))


def returns_tuple(x: LossInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    return (-x.advantages_B1 * x.logprobs), {}


def raises(x: LossInputs, s: LossSettings) -> TokenLoss:
    raise RuntimeError("boom")


def no_gradient(x: LossInputs, s: LossSettings) -> TokenLoss:
    return TokenLoss(-x.advantages_B1 * x.old_logprobs)


def takes_over_unknown(x: LossInputs, s: LossSettings) -> TokenLoss:
    return TokenLoss(-x.advantages_B1 * x.logprobs)


takes_over_unknown.takes_over = {"optimizer"}  # type: ignore[attr-defined]


def aggregation_not_scalar(x: LossInputs, s: LossSettings) -> TokenLoss:
    return TokenLoss(-x.advantages_B1 * x.logprobs)


aggregation_not_scalar.takes_over = {"aggregation"}  # type: ignore[attr-defined]
