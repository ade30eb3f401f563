"""Per-step sums for the controller's learning-curve counters: monotonic under negative values, no step lost."""

from __future__ import annotations

import itertools
import math

from fleetrl import metric_names as mn
from fleetrl.controller.step_sums import CURVE_KEYS, StepSums


def test_sums_split_by_sign_so_counters_never_decrease():
    sums = StepSums()
    seen = []
    for loss in (0.5, -2.0, 0.25, -0.25):
        sums.add({mn.LOSS: loss})
        seen.append((sums.positive[mn.LOSS], sums.negative[mn.LOSS]))
    for (pos_before, neg_before), (pos_after, neg_after) in itertools.pairwise(seen):
        assert pos_after >= pos_before and neg_after >= neg_before
    assert (sums.positive[mn.LOSS], sums.negative[mn.LOSS], sums.count[mn.LOSS]) == (0.75, 2.25, 4)
    assert sums.mean(mn.LOSS) == -1.5 / 4


def test_missing_non_finite_and_unlisted_figures_are_not_counted():
    sums = StepSums()
    sums.add({mn.RAW_REWARD: 1.0, mn.ENTROPY: math.nan, "perf/other": 3.0, mn.GRAD_NORM: True})
    sums.add({mn.RAW_REWARD: 0.0})
    assert sums.steps == 2 and sums.count == {mn.RAW_REWARD: 2}
    assert sums.mean(mn.RAW_REWARD) == 0.5 and math.isnan(sums.mean(mn.ENTROPY))


def test_the_curves_are_named_by_metric_names():
    assert mn.RAW_REWARD in CURVE_KEYS and mn.LOSS in CURVE_KEYS and len(set(CURVE_KEYS)) == len(CURVE_KEYS)
