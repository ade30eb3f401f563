"""A custom policy loss for fleetrl: ratio-clipped REINFORCE with asymmetric clipping and a staleness cut.

Named in a run config by import path (run.toml: `policy_loss = "my_losses:clipped_ratio"`; `fleetrl up` puts the
config's folder on the services' PYTHONPATH) or given to `fleetrl.main(..., policy_loss=clipped_ratio)` (train.py).
The contract (fleetrl.losses.LossInputs in, fleetrl.losses.TokenLoss out) is in docs/losses.md.
"""

from __future__ import annotations

import torch

from fleetrl.losses import LossInputs, LossSettings, TokenLoss, log_ratio

MAX_VERSION_LAG = 2
"""Tokens sampled by a policy more than this many versions older than the batch's newest token get no gradient."""


def clipped_ratio(x: LossInputs, s: LossSettings) -> TokenLoss:
    """Per token: -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) * A * w * pi, r = exp(pi - old).

    The clipped ratio is a constant coefficient (as in CISPO, MiniMax-M1 arXiv:2506.13585), so a kept token's
    gradient is -clip(r) * A * w, and the clip is asymmetric (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476
    §3.1: set eps_clip_high = 0.28 in the run). Unlike CISPO, a token whose ratio has left the range in the
    direction its advantage pushes gets no gradient (PPO's trust region, Schulman et al. 2017), and neither does a
    token more than MAX_VERSION_LAG versions staler than the batch's newest (per-token `versions`).
    fleetrl applies its TIS weights w (through x.tis_weights) and aggregates with loss_agg_mode.
    """
    assert s.eps_clip is not None and s.eps_clip_high is not None  # fleetrl fills them (0.2 when unset)
    ratio = torch.exp(log_ratio(x.logprobs, x.old_logprobs)).detach()
    low, high = 1.0 - s.eps_clip, 1.0 + s.eps_clip_high
    clipped = ((x.advantages_B1 > 0) & (ratio > high)) | ((x.advantages_B1 < 0) & (ratio < low))
    keep = ~clipped
    stale = torch.zeros_like(clipped)
    if x.versions is not None:
        known = x.versions >= 0  # -1: unknown or masked out
        newest = x.versions.max()
        stale = known & (newest - x.versions > MAX_VERSION_LAG)
        keep = keep & ~stale
    loss = -ratio.clamp(low, high) * x.advantages_B1 * x.tis_weights * x.logprobs * keep
    return TokenLoss(loss, ratio_BT=ratio, clipped_BT=clipped, extra_BT={"stale_frac": stale})
