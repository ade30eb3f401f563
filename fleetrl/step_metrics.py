"""Per-step metrics for `log_path/metrics.jsonl`: rewards, sample metrics, turn lengths and version offsets.

Names follow the Fireworks cookbook / Tinker conventions: `reward/mean`, `env/all/<metric>`,
`ac_tokens_per_turn`, `async/version_offset_mean|max`. Pure: the caller adds the trainer's and timing figures.
"""

from __future__ import annotations

import math
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


def sample_metrics(samples: Sequence[RolloutSample], version_offsets: Sequence[int] = ()) -> dict[str, float]:
    """Reward statistics, `env/all/*` means, tokens per assistant turn and version offsets for one step."""
    if not samples:
        return {}
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    out: dict[str, float] = {
        "reward/mean": mean,
        "reward/std": math.sqrt(var),
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
    return out
