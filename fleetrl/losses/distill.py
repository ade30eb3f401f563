"""On-policy distillation as a loss: the student samples, a teacher scores every sampled token, and the per-token
reverse KL is the signal (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines' "On-Policy Distillation",
2025; Tinker cookbook's distillation loop), optionally mixed with the task's advantage.

Per token t of a student sample, with tokens drawn from the student: the single-sample estimate of the reverse KL
KL(student || teacher) is log p_student(x_t) - log p_teacher(x_t), so its negation is an advantage:

    adv_t = (1 - weight) * A + weight * (teacher_t - sg(old_t))

and the loss is the importance-sampled policy gradient -r * adv_t * w (r = exp(pi - old), w the TIS weight), whose
gradient at r = 1 is that of the reverse KL to the teacher (weight 1) plus the task's policy gradient.

The usual way in: set the run's `teacher_model` (the reference then holds the teacher, same tokenizer, checked at
start, and its logprobs reach every loss even with kl_beta = 0) and `distill_weight`: fleetrl.losses.policy mixes
`distillation_advantages` into the advantages of whatever loss the run names (grpo's clip included).
The functions here are the same signal as a loss of its own: `on_policy_distillation` is pure distillation
(weight 1); for a mix, wrap `distillation_loss` in a module-level function of your own
(`def my_loss(x, s): return distillation_loss(x, s, weight=0.5)`) and name it in policy_loss.
"""

from __future__ import annotations

import torch

from fleetrl.losses.contract import LossInputs, TokenLoss
from fleetrl.losses.settings import LossSettings
from fleetrl.losses.variants import log_ratio


def distillation_advantages(
    teacher_BT: torch.Tensor, student_BT: torch.Tensor, advantages_B1: torch.Tensor, weight: float
) -> torch.Tensor:
    """Per-token advantages [B, T]: (1 - weight) * A + weight * (teacher - student), the second term the negated
    single-sample reverse KL of each token (detached: advantages are constants)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"distillation weight must be in [0, 1], got {weight!r}")
    reverse_kl_BT = (student_BT - teacher_BT).detach()
    return (1.0 - weight) * advantages_B1.detach() - weight * reverse_kl_BT


def distillation_loss(x: LossInputs, s: LossSettings, weight: float = 1.0) -> TokenLoss:
    """-r * adv_t * w with adv_t = (1 - weight) * A + weight * (teacher - old) (see the module docstring); reports
    `reverse_kl` (the masked mean of old - teacher per token) as a metric."""
    if x.ref_logprobs is None:
        raise ValueError(
            "on-policy distillation needs the teacher's logprobs: set teacher_model (the reference then holds the "
            "teacher and its logprobs reach the loss as ref_logprobs)"
        )
    advantages_BT = distillation_advantages(x.ref_logprobs, x.old_logprobs, x.advantages_B1, weight)
    ratio = torch.exp(log_ratio(x.logprobs, x.old_logprobs))
    loss = -ratio * advantages_BT * x.tis_weights
    reverse_kl = (x.old_logprobs - x.ref_logprobs).detach()
    return TokenLoss(loss, ratio.detach(), extra_BT={"reverse_kl": reverse_kl})


def on_policy_distillation(x: LossInputs, s: LossSettings) -> TokenLoss:
    """Pure on-policy distillation (weight 1): `policy_loss = "fleetrl.losses.distill:on_policy_distillation"`."""
    return distillation_loss(x, s, weight=1.0)
