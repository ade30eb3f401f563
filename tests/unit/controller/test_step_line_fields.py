"""The step's metrics line as a pure function (fleetrl.controller.step_line): every field from its inputs."""

from __future__ import annotations

import pytest

from fleetrl import metric_names as mn
from fleetrl.controller.step_line import StepTimes, perf_metrics, step_line


def line(**kw):
    args = dict(
        step=3,
        version=3,
        time=1234.5,
        admitted_offsets=(0, 2, 1),
        rejected_rewards=(0.0, 0.0),
        rejected_groups=1,
        done_frac=0.75,
        times=StepTimes(wait=1.0, train=2.0, weight_update=0.5, total=3.0),
        counters={"rows_leased": 7, "rows_accepted": 4},
        tracker_failures=2,
    )
    args.update(kw)
    trainer = {"data/samples": 8.0, "data/tokens": 400.0, "data/groups": 2.0, mn.FILTERED_REWARD: 0.5, "loss": 0.1}
    return step_line(trainer, **args)


def test_a_step_line_carries_the_trainer_figures_and_the_controllers_own():
    out = line()
    assert out["loss"] == 0.1 and out["data/samples"] == 8.0
    assert (out["step"], out["version"], out["time"]) == (3, 3, 1234.5)
    assert out["async/admitted_offset_max"] == 2
    assert out[mn.PROGRESS_DONE_FRAC] == 0.75
    assert out["producer/rows_leased"] == 7 and out["producer/rows_accepted"] == 4
    assert out[mn.TRACKER_FAILURES] == 2
    # 8 trained samples at 0.5 and 2 rejected at 0.0; one group of three refused
    assert out[mn.RAW_REWARD] == pytest.approx(4.0 / 10)
    assert out[mn.FILTER_RATIO] == pytest.approx(1 / 3) and out[mn.GROUPS_FILTERED] == 1.0


def test_perf_rates_are_over_the_wait_plus_the_step():
    out = line()
    assert out["perf/step_time"] == 4.0 and out["perf/train_time"] == 2.0 and out["perf/train_wait_time"] == 1.0
    assert out["perf/wait_time_ratio"] == 0.25 and out["perf/weight_update_time"] == 0.5
    assert out[mn.SAMPLES_PER_S] == 2.0 and out["perf/step_tokens_per_s"] == 100.0


def test_no_offsets_and_a_zero_step_time_give_zeros_not_errors():
    out = line(admitted_offsets=())
    assert out["async/admitted_offset_max"] == 0
    perf = perf_metrics(StepTimes(0.0, 0.0, 0.0, 0.0), samples=8.0, tokens=100.0)
    assert perf["perf/wait_time_ratio"] == 0.0 and perf[mn.SAMPLES_PER_S] == 0.0
    assert perf["perf/step_tokens_per_s"] == 0.0
