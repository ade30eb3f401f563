"""fleetrl.losses: the policy losses (grpo, ppo, dapo, importance_sampling, reinforce, dro, gspo,
cispo), custom losses named by import path, truncated importance sampling / IcePop, and loss aggregation. Pure
torch; see docs/losses.md for the formulas, their papers and the contract of a custom loss.

    from fleetrl.losses import policy_loss, LOSS_NAMES
    loss, metrics = policy_loss("grpo", logprobs, old_logprobs, rollout_logprobs, advantages, mask)

    from fleetrl.losses import LossInputs, LossSettings, TokenLoss   # a custom loss's contract
    def my_loss(x: LossInputs, s: LossSettings) -> TokenLoss: ...     # policy_loss = "my_module:my_loss"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetrl.lazy_import import lazy_names
from fleetrl.losses.custom import loss_import_path
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
    from fleetrl.losses.contract import TAKES_OVER, CustomLoss, LossInputs, TokenLoss
    from fleetrl.losses.policy import policy_loss
    from fleetrl.losses.tis import TisWeights, tis_weights
    from fleetrl.losses.variants import clipped_surrogate, k3_kl, log_ratio

# The torch parts load on first use: the names and settings above are all a config check needs (`fleetrl up`,
# the controller and the gateways validate configs and never compute a loss, and importing torch costs ~1 s).
_LAZY = {
    "aggregate_loss": "aggregation",
    "masked_mean": "aggregation",
    "masked_sum": "aggregation",
    "policy_loss": "policy",
    "TisWeights": "tis",
    "tis_weights": "tis",
    "CustomLoss": "contract",
    "LossInputs": "contract",
    "TAKES_OVER": "contract",
    "TokenLoss": "contract",
    "clipped_surrogate": "variants",
    "k3_kl": "variants",
    "log_ratio": "variants",
}

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "AGG_MODES",
    "LOG_RATIO_CLAMP",
    "LOSS_NAMES",
    "TAKES_OVER",
    "TIS_LEVELS",
    "CustomLoss",
    "LossInputs",
    "LossSettings",
    "TisWeights",
    "TokenLoss",
    "aggregate_loss",
    "clipped_surrogate",
    "k3_kl",
    "log_ratio",
    "loss_import_path",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "resolve_loss_settings",
    "tis_weights",
]
