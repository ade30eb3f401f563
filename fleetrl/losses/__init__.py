"""fleetrl.losses: the policy losses (grpo, ppo, dapo, importance_sampling, reinforce, dro, gspo,
cispo), truncated importance sampling / IcePop, and loss aggregation. Pure torch; see
docs/losses.md for the formulas and their papers.

    from fleetrl.losses import policy_loss, LOSS_NAMES
    loss, metrics = policy_loss("grpo", logprobs, old_logprobs, rollout_logprobs, advantages, mask)
"""

from fleetrl.losses.aggregation import aggregate_loss, masked_mean, masked_sum
from fleetrl.losses.policy import policy_loss
from fleetrl.losses.settings import (
    AGG_MODES,
    LOG_RATIO_CLAMP,
    LOSS_NAMES,
    TIS_LEVELS,
    LossSettings,
    resolve_loss_settings,
)
from fleetrl.losses.tis import TisWeights, tis_weights

__all__ = [
    "AGG_MODES",
    "LOG_RATIO_CLAMP",
    "LOSS_NAMES",
    "TIS_LEVELS",
    "LossSettings",
    "TisWeights",
    "aggregate_loss",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "resolve_loss_settings",
    "tis_weights",
]
