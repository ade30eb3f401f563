"""fleetrl.losses: the policy losses (grpo, ppo, dapo, importance_sampling, reinforce, dro, gspo,
cispo), truncated importance sampling / IcePop, and loss aggregation. Pure torch; see
docs/losses.md for the formulas and their papers.

    from fleetrl.losses import policy_loss, LOSS_NAMES
    loss, metrics = policy_loss("grpo", logprobs, old_logprobs, rollout_logprobs, advantages, mask)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetrl.lazy_import import lazy_names
from fleetrl.losses.settings import (
    AGG_MODES,
    LOG_RATIO_CLAMP,
    LOSS_NAMES,
    TIS_LEVELS,
    LossSettings,
    resolve_loss_settings,
)

if TYPE_CHECKING:
    from fleetrl.losses.aggregation import aggregate_loss, masked_mean, masked_sum
    from fleetrl.losses.policy import policy_loss
    from fleetrl.losses.tis import TisWeights, tis_weights

# The torch parts load on first use: the names and settings above are all a config check needs (`fleetrl up`,
# the controller and the gateways validate configs and never compute a loss, and importing torch costs ~1 s).
_LAZY = {
    "aggregate_loss": "aggregation",
    "masked_mean": "aggregation",
    "masked_sum": "aggregation",
    "policy_loss": "policy",
    "TisWeights": "tis",
    "tis_weights": "tis",
}

__getattr__ = lazy_names(__name__, _LAZY)

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
