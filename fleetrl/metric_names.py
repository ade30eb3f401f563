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
