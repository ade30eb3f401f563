"""Per-token policy losses, one function per name in LOSS_NAMES.

Notation per token: pi = logprobs (carries the gradient), old = old_logprobs (policy at the start of
the batch), inf = rollout_logprobs (sampler), ref = ref_logprobs, A = the sample's advantage,
w = the TIS weight (fleetrl.losses.tis), sg = stop-gradient, and every log-ratio clamped to [-20, 20]
before exp(); r = exp(pi - old). Each function returns the per-token loss [B, T] (before masking and
aggregation) plus what the metrics need. Inputs arrive sanitised: masked-out positions hold 0 in
every tensor, and old/inf/ref/A/w are detached. The contract (LossInputs, TokenLoss) is fleetrl.losses.contract;
a custom loss has the same signature and may use the helpers here (log_ratio, k3_kl, clipped_surrogate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fleetrl.losses.aggregation import masked_mean
from fleetrl.losses.contract import LossInputs, TokenLoss
from fleetrl.losses.settings import LOG_RATIO_CLAMP, LossSettings


def log_ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b clamped to [-20, 20], so exp() of it stays finite."""
    return (a - b).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - pi) - (ref - pi) - 1 >= 0, an unbiased, low-variance estimate of
    KL(pi || ref) (Schulman 2020, "Approximating KL Divergence"; GRPO, Shao et al. 2024, eq. 4).
    Its gradient in pi is 1 - exp(ref - pi)."""
    d = log_ratio(ref_logprobs, logprobs)
    return torch.exp(d) - d - 1.0


def clipped_surrogate(
    log_ratio_BT: torch.Tensor, advantages_B1: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped surrogate as a loss (Schulman et al. 2017, eq. 7):
    max(-r*A, -clip(r, 1 - eps_low, 1 + eps_high)*A). Returns (loss, detached r, clip-in-effect)."""
    ratio = torch.exp(log_ratio_BT)
    unclipped = -advantages_B1 * ratio
    clipped = -advantages_B1 * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    # An explicit where (not torch.maximum, which splits the gradient of ties in half): the clipped
    # branch is chosen only when it is strictly larger, i.e. r is outside the range and the clamp
    # has already cut the gradient.
    in_effect = (clipped > unclipped).detach()
    return torch.where(in_effect, clipped, unclipped), ratio.detach(), in_effect


def _eps(s: LossSettings) -> tuple[float, float]:
    if s.eps_clip is None or s.eps_clip_high is None:
        raise ValueError("eps_clip/eps_clip_high unset: pass settings through resolve_loss_settings")
    return s.eps_clip, s.eps_clip_high


def _grpo(x: LossInputs, s: LossSettings) -> TokenLoss:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3): clipped surrogate times the TIS
    weight, plus kl_beta * k3 to the reference policy when ref_logprobs are given."""
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss, ratio, clipped = clipped_surrogate(lr, x.advantages_B1, *_eps(s))
    loss = loss * x.tis_weights
    if x.ref_logprobs is not None and s.kl_beta > 0:
        loss = loss + s.kl_beta * k3_kl(x.logprobs, x.ref_logprobs)
    return TokenLoss(loss, ratio, clipped)


def _ppo(x: LossInputs, s: LossSettings) -> TokenLoss:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347, eq. 7) times the TIS weight; no KL term."""
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss, ratio, clipped = clipped_surrogate(lr, x.advantages_B1, *_eps(s))
    return TokenLoss(loss * x.tis_weights, ratio, clipped)


def _dapo(x: LossInputs, s: LossSettings) -> TokenLoss:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): the clipped surrogate with clip-higher (eps 0.2 /
    0.28, §3.1), no KL. Optional dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the
    loss is bounded above by -c*A, so a huge r on a bad token cannot dominate the batch."""
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss, ratio, clipped = clipped_surrogate(lr, x.advantages_B1, *_eps(s))
    extra: dict[str, torch.Tensor] = {}
    if s.dual_clip_c is not None:
        bound = -s.dual_clip_c * x.advantages_B1
        dual = ((x.advantages_B1 < 0) & (loss > bound)).detach()
        loss = torch.where(dual, bound.expand_as(loss), loss)
        extra["dual_clip_frac"] = dual
    return TokenLoss(loss * x.tis_weights, ratio, clipped, extra)


def _importance_sampling(x: LossInputs, s: LossSettings) -> TokenLoss:
    """Off-policy policy gradient with an unclipped ratio: -r * A * w (Tinker's importance_sampling)."""
    ratio = torch.exp(log_ratio(x.logprobs, x.old_logprobs))
    loss = -ratio * x.advantages_B1 * x.tis_weights
    return TokenLoss(loss, ratio.detach(), torch.zeros_like(x.mask, dtype=torch.bool))


def _reinforce(x: LossInputs, s: LossSettings) -> TokenLoss:
    """Vanilla REINFORCE (Williams 1992): -A * pi. On-policy by assumption: no ratio, no TIS weight."""
    loss = -x.advantages_B1 * x.logprobs
    ratio = torch.exp(log_ratio(x.logprobs, x.old_logprobs)).detach()
    return TokenLoss(loss, ratio, torch.zeros_like(x.mask, dtype=torch.bool))


def _dro(x: LossInputs, s: LossSettings) -> TokenLoss:
    """DRO (Richemond et al. 2024, arXiv:2405.19107): -pi*A*w + 0.5*beta*(pi - old)^2, a policy
    gradient kept near the behaviour policy by a quadratic penalty on the log-ratio."""
    lr = log_ratio(x.logprobs, x.old_logprobs)
    loss = -x.logprobs * x.advantages_B1 * x.tis_weights + 0.5 * s.dro_beta * lr.square()
    return TokenLoss(loss, torch.exp(lr).detach(), torch.zeros_like(x.mask, dtype=torch.bool))


def _gspo(x: LossInputs, s: LossSettings) -> TokenLoss:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), GSPO-token form: the sequence ratio
    s = exp(masked mean_t of (pi - old)) applied per token as exp(pi - sg(pi) + sg(log s)), whose
    value is s and whose gradient is s * grad(pi); clipped surrogate with eps 3e-4 / 4e-4, times w.
    With seq-mean-token-mean aggregation this is the paper's sequence-level GSPO objective."""
    lr = log_ratio(x.logprobs, x.old_logprobs)
    log_seq_ratio_B1 = masked_mean(lr, x.mask, dim=-1).unsqueeze(-1)
    log_seq_ratio_B1 = log_seq_ratio_B1.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    token_lr = x.logprobs - x.logprobs.detach() + log_seq_ratio_B1
    loss, ratio, clipped = clipped_surrogate(token_lr, x.advantages_B1, *_eps(s))
    return TokenLoss(loss * x.tis_weights, ratio, clipped)


def _cispo(x: LossInputs, s: LossSettings) -> TokenLoss:
    """CISPO (MiniMax 2025, MiniMax-M1, arXiv:2506.13585): -sg(clip(r, 1-eps_low,
    1+eps_high)) * pi * A * w. The ratio is clipped but, being a constant, never cuts a token's
    gradient: every token keeps a (bounded) REINFORCE-style gradient -clip(r)*A*w."""
    ratio = torch.exp(log_ratio(x.logprobs, x.old_logprobs)).detach()
    eps_low, eps_high = _eps(s)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    loss = -ratio.clamp(low, high) * x.logprobs * x.advantages_B1 * x.tis_weights
    return TokenLoss(loss, ratio, (ratio < low) | (ratio > high))


LossFn = Callable[[LossInputs, LossSettings], TokenLoss]

LOSSES: dict[str, LossFn] = {
    "grpo": _grpo,
    "ppo": _ppo,
    "dapo": _dapo,
    "importance_sampling": _importance_sampling,
    "reinforce": _reinforce,
    "dro": _dro,
    "gspo": _gspo,
    "cispo": _cispo,
}
