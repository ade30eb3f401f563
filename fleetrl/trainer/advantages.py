"""Group-relative advantages (GRPO, Shao et al. 2024, eq. 3; Dr. GRPO's mean-centering, Liu et al. 2025).

`standardize`: A_i = (r_i - mean(r)) / (std_unbiased(r) + 1e-8), and all zeros when std < 1e-8.
`center`: A_i = r_i - mean(r) (no division by std: Dr. GRPO / Tinker style).
A group of one carries no relative signal and is dropped (None).
`member_advantages`: the same over a group's members (trajectories) when a member may be several samples (a
RolloutRun whose segments do not extend each other): one reward per member, and each member's advantage for every
one of its samples, so a split trajectory counts once in the mean and std, as if it were unsplit.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

AdvantageMode = Literal["standardize", "center"]
ADVANTAGE_MODES: tuple[str, ...] = ("standardize", "center")
STD_EPS = 1e-8
FLOAT_MAX = 3.0e38  # below float32's largest value: the trainer's advantage tensors are float32


def group_advantages(rewards: Sequence[float], mode: AdvantageMode = "standardize") -> list[float] | None:
    """Advantages for one group of rewards; None for a group of fewer than two samples."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"advantage_mode {mode!r} is not one of {ADVANTAGE_MODES}")
    n = len(rewards)
    if n < 2:
        return None
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"reward {i} of the group is not finite: {r}")
    # Finite but huge rewards (e.g. +-1e308) would overflow the sum, the deviations and their squares. Working on
    # rewards divided by the largest magnitude keeps every intermediate in [-2, 4n]; standardized advantages are
    # scale-free, so they come out the same (and bounded by sqrt(n - 1)) whatever the reward scale.
    scale = max(abs(r) for r in rewards)
    if scale == 0.0:
        return [0.0] * n
    unit = [r / scale for r in rewards]
    mean = math.fsum(unit) / n
    centered_unit = [u - mean for u in unit]
    if mode == "center":
        # Center mode keeps the reward scale: a deviation beyond the float range saturates instead of becoming inf.
        return [math.copysign(min(abs(c) * scale, FLOAT_MAX), c) for c in centered_unit]
    std_unit = math.sqrt(math.fsum(c * c for c in centered_unit) / (n - 1))
    if std_unit * scale < STD_EPS:
        return [0.0] * n
    return [c / (std_unit + STD_EPS / scale) for c in centered_unit]


def member_advantages(
    rewards: Sequence[float], members: Sequence[int | None], mode: AdvantageMode = "standardize"
) -> list[float] | None:
    """Advantages per sample, computed over the group's members: `members[i]` is sample i's member (None: a
    member of its own); a member's reward is its first sample's. None for a group of fewer than two members."""
    if len(members) != len(rewards):
        raise ValueError(f"{len(members)} members for {len(rewards)} rewards")
    keys: list[Hashable] = [("sample", i) if m is None else ("member", m) for i, m in enumerate(members)]
    member_reward: dict[Hashable, float] = {}
    for key, reward in zip(keys, rewards, strict=True):
        member_reward.setdefault(key, reward)
    advantages = group_advantages(list(member_reward.values()), mode)
    if advantages is None:
        return None
    by_member = dict(zip(member_reward, advantages, strict=True))
    return [by_member[key] for key in keys]
