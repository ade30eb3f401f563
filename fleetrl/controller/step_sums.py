"""Running sums of the per-step learning-curve figures, for Prometheus counters that lose no step.

A gauge holding the last step's value is sampled once per scrape: steps shorter than the scrape interval never
show, and a curve drawn from it is whichever step happened to be last. Counters of the sum and of the number of
steps do not lose any: `rate(sum) / rate(count)` over a window is the mean over every step that ended in it.

A counter must never decrease, and a loss or a reward can be negative, so each sum is kept as two counters, of the
positive and of the negative parts (Prometheus's own advice for negative observations):

    mean = (rate(sum{sign="positive"}) - rate(sum{sign="negative"})) / rate(count)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fleetrl import metric_names as mn

# The per-step figures the dashboard's learning curves draw (metrics.jsonl keys, fleetrl.metric_names).
CURVE_KEYS = (
    mn.RAW_REWARD,
    mn.FILTERED_REWARD,
    mn.FILTER_RATIO,
    mn.LOSS,
    mn.KL_REFERENCE,
    mn.KL_SAMPLE_TRAIN,
    mn.ENTROPY,
    mn.GRAD_NORM,
    mn.LEARNING_RATE,
    mn.RESPONSE_LENGTH_MEAN,
    mn.RESPONSE_CLIP_RATIO,
    mn.OFFSET_MEAN,
    mn.OFFSET_MAX,
    mn.SAMPLES_PER_S,
    mn.STEP_TIME,
)


class StepSums:
    """Per metric: the number of steps that reported it and the sums of its positive and negative parts."""

    def __init__(self, keys: tuple[str, ...] = CURVE_KEYS) -> None:
        self.keys = keys
        self.steps = 0
        self.count: dict[str, int] = {}
        self.positive: dict[str, float] = {}
        self.negative: dict[str, float] = {}  # the sum of |value| over the negative values

    def add(self, line: Mapping[str, Any]) -> None:
        """Count one step's metrics line (non-finite or missing figures are skipped, per metric)."""
        self.steps += 1
        for key in self.keys:
            value = line.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                continue
            self.count[key] = self.count.get(key, 0) + 1
            self.positive.setdefault(key, 0.0)
            self.negative.setdefault(key, 0.0)
            if value >= 0:
                self.positive[key] += value
            else:
                self.negative[key] -= value

    def mean(self, key: str) -> float:
        """The mean over every counted step (what the dashboard's ratio of rates gives over all time)."""
        n = self.count.get(key, 0)
        return (self.positive.get(key, 0.0) - self.negative.get(key, 0.0)) / n if n else math.nan
