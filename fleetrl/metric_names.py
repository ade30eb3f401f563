"""Names of the per-step metrics that several parts of fleetrl read (console, trackers, plot, docs).

Prefixes follow the conventions users' dashboards already use (the Fireworks cookbook's and Tinker's):
``train/`` (the loss and its terms), ``optim/`` (optimizer and policy-drift figures), ``perf/`` (timings and
throughput), ``async/`` (off-policy offsets), ``rollout/`` (rewards and lengths of what was sampled),
``env/all/`` (the rollout function's own metrics), ``progress/`` (where the run is), ``eval/`` (evaluations).
Every name a per-step line carries is listed in docs/metrics.md.
"""

from __future__ import annotations

STEP = "step"
VERSION = "version"

LOSS = "train/loss"
ENTROPY = "optim/entropy"
KL_REFERENCE = "train/kl_ref"
KL_SAMPLE_TRAIN = "optim/kl_sample_train_v1"
LEARNING_RATE = "optim/lr"
GRAD_NORM = "optim/grad_norm"

RAW_REWARD = "rollout/raw_reward"
FILTERED_REWARD = "rollout/filtered_reward"
FILTER_RATIO = "rollout/filter_ratio"
RESPONSE_LENGTH_MEAN = "rollout/response_length/mean"
RESPONSE_LENGTH_MAX = "rollout/response_length/max"
RESPONSE_CLIP_RATIO = "rollout/response_length/clip_ratio"

OFFSET_MEAN = "async/version_offset_mean"
OFFSET_MAX = "async/version_offset_max"

SAMPLES_PER_S = "perf/samples_per_s"
STEP_TIME = "perf/step_time"

PROGRESS_DONE_FRAC = "progress/done_frac"

# --- the rest of a per-step line: trainer figures (fleetrl.trainer), rollout statistics (fleetrl.step_metrics) ---
OPTIMIZER_STEPS = "optim/steps"
EMPTY_STEP = "train/empty_step"
REWARD_STD = "rollout/reward_std"
REWARD_MIN = "rollout/reward_min"
REWARD_MAX = "rollout/reward_max"
TOKENS_PER_TURN = "rollout/ac_tokens_per_turn"
TOKENS_GENERATED = "rollout/tokens_generated"
GROUPS_FILTERED = "rollout/groups_filtered"
TRACKER_FAILURES = "trackers/failures"

# The loss's own figures (fleetrl.losses.policy_loss returns them unprefixed, as a loss function's vocabulary):
# their names in a per-step line. ``train/`` for the loss's terms, ``optim/`` for policy drift.
LOSS_METRIC_KEYS: dict[str, str] = {
    "clip_frac": "train/clip_frac",
    "dual_clip_frac": "train/dual_clip_frac",
    "ratio_mean": "train/ratio_mean",
    "tis_weight_mean": "train/tis_weight_mean",
    "tis_clip_frac": "train/tis_clip_frac",
    "icepop_frac": "train/icepop_frac",
    "ref_kl": KL_REFERENCE,
    "entropy": ENTROPY,
    "ppo_kl": "optim/ppo_kl",
    "kl_sample_train_v1": KL_SAMPLE_TRAIN,
    "kl_sample_train_v2": "optim/kl_sample_train_v2",
}


def loss_metric_key(name: str) -> str:
    """The per-step name of a figure `policy_loss` returns: `clip_frac` -> `train/clip_frac`; a figure a loss
    variant adds that is not listed goes under ``train/`` too."""
    return LOSS_METRIC_KEYS.get(name, name if "/" in name else f"train/{name}")
