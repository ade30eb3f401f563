"""Per-step metrics for `log_path/metrics.jsonl`: rewards, response lengths, sample metrics and version offsets.

Names follow the Fireworks cookbook / Tinker conventions (fleetrl.metric_names): `rollout/filtered_reward` (the
samples trained, after the gateways' dynamic filter), `rollout/response_length/mean|max|clip_ratio`,
`env/all/<metric>` (a sample metric already named `env/<tag>/<metric>` is kept as it is),
`async/version_offset_mean|max|min`. `reward_filter_metrics` adds `rollout/raw_reward` and
`rollout/filter_ratio` from the groups the dynamic filter refused. Pure: the caller adds the trainer's and timing
figures (the controller's whole step line is built by fleetrl.controller.step_line).
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence

from fleetrl import metric_names as mn
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
    """Reward and response-length statistics, `env/all/*` means, tokens per assistant turn and version offsets
    for one step's trained samples."""
    if not samples:
        return {}
    rewards = [s.reward for s in samples]
    mean, std = _mean_std(rewards)
    generated = [s.num_generated for s in samples]
    out: dict[str, float] = {
        mn.FILTERED_REWARD: mean,
        mn.REWARD_STD: std,
        mn.REWARD_MIN: min(rewards),
        mn.REWARD_MAX: max(rewards),
        mn.RESPONSE_LENGTH_MEAN: sum(generated) / len(generated),
        mn.RESPONSE_LENGTH_MAX: float(max(generated)),
        # Cut at max_completion_tokens (the sampler's "length" finish): a high ratio means the limit is too low.
        mn.RESPONSE_CLIP_RATIO: sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    totals: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        for name, value in s.metrics.items():
            totals[name].append(float(value))
    for name, values in sorted(totals.items()):
        # A name already under env/ (env/<tag>/<metric>, fleetrl.tinker's logging tags) is kept as it is.
        out[name if name.startswith("env/") else f"env/all/{name}"] = sum(values) / len(values)
    turns = sum(assistant_turns(s.loss_mask) for s in samples)
    out[mn.TOKENS_PER_TURN] = sum(generated) / max(turns, 1)
    out[mn.TOKENS_GENERATED] = float(sum(generated))
    if version_offsets:
        out[mn.OFFSET_MEAN] = sum(version_offsets) / len(version_offsets)
        out[mn.OFFSET_MAX] = float(max(version_offsets))
        out["async/version_offset_min"] = float(min(version_offsets))
    return out


def reward_filter_metrics(
    trained: Mapping[str, float], filtered_rewards: Sequence[float], filtered_groups: int
) -> dict[str, float]:
    """`rollout/raw_reward` (every sample the gateways scored: the trained ones and those of groups the dynamic
    filter refused), `rollout/filter_ratio` (the share of groups refused) and `rollout/groups_filtered`.

    trained: the step's line so far (the trainer's `rollout/filtered_reward`, `data/samples`, `data/groups`);
    filtered_rewards, filtered_groups: the rewards and number of groups the gateways reported rejected since the
    previous step."""
    n_trained = float(trained.get("data/samples", 0.0))
    groups = float(trained.get("data/groups", 0.0)) + float(trained.get("data/groups_skipped", 0.0))
    total = math.fsum([trained.get(mn.FILTERED_REWARD, 0.0) * n_trained, *filtered_rewards])
    count = n_trained + len(filtered_rewards)
    out = {
        mn.GROUPS_FILTERED: float(filtered_groups),
        mn.FILTER_RATIO: filtered_groups / (groups + filtered_groups) if groups + filtered_groups else 0.0,
    }
    if count:
        out[mn.RAW_REWARD] = total / count
    return out


def done_fraction(step: int, max_steps: int | None, total_rows: int, groups_per_step: int) -> float:
    """`progress/done_frac`: the share of the run's steps done, the run being max_steps long or as many steps as
    the data (rows x epochs) fills, whichever ends first (rows the gateways reject make it end a little earlier)."""
    from_data = -(-total_rows // max(groups_per_step, 1))
    total = min(max_steps, from_data) if max_steps else from_data
    return min(step / total, 1.0) if total > 0 else 1.0
