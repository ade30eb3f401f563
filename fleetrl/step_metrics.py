"""Per-step metrics for `log_path/metrics.jsonl`: rewards, sample metrics, turn lengths and version offsets.

Names follow the Fireworks cookbook / Tinker conventions: `reward/mean`, `env/all/<metric>`,
`ac_tokens_per_turn`, `async/version_offset_mean|max|min`. Pure: the caller adds the trainer's and timing figures.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Sequence

from fleetrl.rollout import RolloutSample


def assistant_turns(loss_mask: Sequence[int]) -> int:
    """Number of assistant turns: runs of 1s in the mask (a 0 -> 1 transition starts one)."""
    turns, prev = 0, 0
    for m in loss_mask:
        if m and not prev:
            turns += 1
        prev = m
    return turns


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std that cannot overflow for finite inputs (huge rewards are scaled down first); a
    std beyond the float range saturates at the largest float."""
    scale = max(abs(v) for v in values)
    if scale == 0.0:
        return 0.0, 0.0
    unit = [v / scale for v in values]
    mean_unit = math.fsum(unit) / len(unit)
    std_unit = math.sqrt(math.fsum((u - mean_unit) ** 2 for u in unit) / len(unit))
    return mean_unit * scale, min(std_unit * scale, sys.float_info.max)


def sample_metrics(samples: Sequence[RolloutSample], version_offsets: Sequence[int] = ()) -> dict[str, float]:
    """Reward statistics, `env/all/*` means, tokens per assistant turn and version offsets for one step."""
    if not samples:
        return {}
    rewards = [s.reward for s in samples]
    mean, std = _mean_std(rewards)
    out: dict[str, float] = {
        "reward/mean": mean,
        "reward/std": std,
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    }
    totals: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        for name, value in s.metrics.items():
            totals[name].append(float(value))
    for name, values in sorted(totals.items()):
        out[f"env/all/{name}"] = sum(values) / len(values)
    ac_tokens = sum(s.num_generated for s in samples)
    turns = sum(assistant_turns(s.loss_mask) for s in samples)
    out["ac_tokens_per_turn"] = ac_tokens / max(turns, 1)
    out["tokens/generated"] = float(ac_tokens)
    out["finish/length_frac"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    if version_offsets:
        out["async/version_offset_mean"] = sum(version_offsets) / len(version_offsets)
        out["async/version_offset_max"] = float(max(version_offsets))
        out["async/version_offset_min"] = float(min(version_offsets))
    return out
