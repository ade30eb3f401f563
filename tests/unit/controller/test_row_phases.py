"""The gateways' per-row phase seconds become a step's perf/* means (fleetrl.controller.row_phases)."""

from __future__ import annotations

import math

import pytest

from fleetrl.controller import row_phases
from fleetrl.controller.row_phases import RowPhases
from fleetrl.controller.step_line import StepTimes, step_line


def test_a_steps_phases_are_the_means_over_its_rows_and_those_rows_are_forgotten():
    phases = RowPhases()
    phases.record(1, {"lease": 0.01, "rollouts": 1.0, "send": 0.02})
    phases.record(2, {"lease": 0.03, "rollouts": 3.0, "send": 0.04})
    phases.record(3, {"lease": 9.0, "rollouts": 9.0, "send": 9.0})  # a later step's row
    out = phases.take_step([1, 2])
    assert out == pytest.approx({"perf/lease_time": 0.02, "perf/rollout_time": 2.0, "perf/group_send_time": 0.03})
    assert len(phases) == 1 and phases.take_step([1, 2]) == {}


def test_forged_figures_are_ignored_and_a_retried_rows_last_report_wins():
    phases = RowPhases()
    phases.record(1, {"lease": -1.0, "rollouts": math.nan, "send": math.inf, "bogus": 1.0})
    assert len(phases) == 0
    phases.record(2, {"rollouts": 1e9})
    assert len(phases) == 0
    phases.record(3, {"rollouts": 5.0})
    phases.record(3, {"rollouts": 1.0})
    assert phases.take_step([3]) == {"perf/rollout_time": 1.0}


def test_rows_never_trained_do_not_grow_without_bound(monkeypatch):
    monkeypatch.setattr(row_phases, "MAX_ROWS", 4)
    phases = RowPhases()
    for row_id in range(10):
        phases.record(row_id, {"rollouts": float(row_id)})
    assert len(phases) == 4
    assert phases.take_step(range(10)) == {"perf/rollout_time": pytest.approx((6 + 7 + 8 + 9) / 4)}


def test_the_step_line_carries_every_phase():
    times = StepTimes(wait=1.0, train=2.0, weight_update=0.5, total=3.0, fetch=0.3, swap=0.01, gate_open=0.6)
    line = step_line(
        {"data/samples": 8.0},
        step=1,
        version=1,
        time=0.0,
        admitted_offsets=(0,),
        rejected_rewards=(),
        rejected_groups=0,
        done_frac=0.5,
        times=times,
        counters={},
        tracker_failures=0,
        row_phases={"perf/rollout_time": 0.7},
    )
    assert line["perf/weight_fetch_time"] == 0.3 and line["perf/weight_swap_time"] == 0.01
    assert line["perf/gate_open_time"] == 0.6 and line["perf/rollout_time"] == 0.7
