"""Group-relative advantages (GRPO, Shao et al. 2024, eq. 3; Dr. GRPO's mean-centering, Liu et al. 2025).

`standardize`: A_i = (r_i - mean(r)) / (std_unbiased(r) + 1e-8), and all zeros when std < 1e-8.
`center`: A_i = r_i - mean(r) (no division by std: Dr. GRPO / Tinker style).
A group of one carries no relative signal and is dropped (None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

AdvantageMode = Literal["standardize", "center"]
ADVANTAGE_MODES: tuple[str, ...] = ("standardize", "center")
STD_EPS = 1e-8


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
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if mode == "center":
        return centered
    std = math.sqrt(sum(c * c for c in centered) / (n - 1))
    if std < STD_EPS:
        return [0.0] * n
    return [c / (std + STD_EPS) for c in centered]
