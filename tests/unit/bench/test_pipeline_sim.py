"""bench/pipeline_sim.py: the simulated loop follows the controller's rules (serial sums, overlap hides a short push,
the gate's bound holds for every trained group, O = 0 never overlaps, a newer version supersedes a waiting one) and
reads bench/overlap.py's metrics as that bench does. Pure: no services, no clock."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_pipeline_sim", REPO / "bench" / "pipeline_sim.py")
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim
_spec.loader.exec_module(sim)

BASE = sim.LoopRates(train_s=3.0, rollout_s=1.0, transfer_s=1.5, apply_s=0.5, groups_per_step=2, steps=20)


def test_serial_on_policy_period_is_rollout_plus_train_plus_push():
    figures = sim.simulate(replace(BASE, max_offpolicy=0))
    assert figures.period_s == pytest.approx(1.0 + 3.0 + 1.5 + 0.5)
    assert all(wait == pytest.approx(2.0) for wait in figures.push_wait_s)


def test_serial_with_one_offpolicy_version_hides_rollouts_but_not_the_push():
    figures = sim.simulate(replace(BASE, max_offpolicy=1, overlap=False))
    assert figures.period_s == pytest.approx(3.0 + 1.5 + 0.5)


def test_overlap_hides_a_push_shorter_than_training():
    figures = sim.simulate(replace(BASE, max_offpolicy=1, overlap=True))
    assert figures.period_s == pytest.approx(3.0)
    assert figures.idle_share(skip=3) == pytest.approx(0.0, abs=1e-9)
    assert all(wait == 0.0 for wait in figures.push_wait_s)
    assert figures.version_latency_s() == pytest.approx(2.0)
    # every push ran beside a TrainStep
    for _, start, served in figures.push_spans[1:]:
        assert any(s < served and start < e for s, e in figures.train_spans)


def test_zero_offpolicy_never_overlaps_even_when_overlap_is_asked_for():
    figures = sim.simulate(replace(BASE, max_offpolicy=0, overlap=True))
    for _, start, served in figures.push_spans:
        assert not any(s < served - 1e-9 and start < e - 1e-9 for s, e in figures.train_spans)
    assert figures.max_offset == 0


@pytest.mark.parametrize("offpolicy", [0, 1, 2, 3])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("train_s", "rollout_s", "transfer_s"), [(1.0, 0.3, 5.0), (1.0, 4.0, 0.2), (2.0, 2.0, 2.0)])
def test_no_trained_group_exceeds_the_bound(offpolicy, overlap, train_s, rollout_s, transfer_s):
    rates = sim.LoopRates(
        train_s=train_s,
        rollout_s=rollout_s,
        transfer_s=transfer_s,
        apply_s=0.1,
        groups_per_step=3,
        max_offpolicy=offpolicy,
        overlap=overlap,
        max_rows_in_flight=5,
        steps=30,
    )
    figures = sim.simulate(rates)
    assert len(figures.trained_offsets) == 30
    assert all(0 <= o <= offpolicy for offsets in figures.trained_offsets for o in offsets)
    # Rows take equal times, so they finish in the order admitted, and the gate alone keeps each one fresh for the
    # step it joins: the scheduler's check against that step never has to requeue one.
    assert figures.rows_requeued_stale == 0


def test_a_slow_push_is_superseded_and_the_gate_throttles_the_trainer():
    # A push five times a step: one in flight, newer versions supersede the waiting one, the replicas jump.
    rates = sim.LoopRates(train_s=1.0, rollout_s=0.1, transfer_s=5.0, max_offpolicy=2, steps=30)
    figures = sim.simulate(rates)
    assert figures.superseded > 0
    served = figures.versions_served
    assert served == sorted(served) and len(served) < 30 and any(b - a > 1 for a, b in itertools.pairwise(served))
    # the trainer cannot run more than O + 1 steps past the served version: about (O + 1) steps per push
    assert figures.mean_period_s(5) > 5.0 / 3 - 1e-6
    # pushes never overlap one another
    spans = sorted((start, end) for _, start, end in figures.push_spans)
    assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_contention_slows_both_sides_of_an_overlapped_push():
    alone = sim.simulate(replace(BASE, max_offpolicy=1))
    shared = sim.simulate(replace(BASE, max_offpolicy=1, train_contention=1.0, push_contention=0.5))
    # the transfer (1.5 s) runs beside training at 1/1.5 speed: 2.25 s, costing the trainer 2.25 / 2 s
    assert shared.version_latency_s() == pytest.approx(2.25 + 0.5)
    assert shared.period_s == pytest.approx(3.0 + 2.25 / 2)
    assert alone.period_s == pytest.approx(3.0)


def test_the_apply_pauses_generation():
    # O = 0: rollouts start after the gate opens, so they never overlap an apply; O = 1 rows do, and finish later.
    rates = replace(BASE, train_s=1.0, rollout_s=3.0, transfer_s=0.2, apply_s=1.0, max_offpolicy=1, overlap=True)
    paused = sim.simulate(rates).mean_period_s(5)
    unpaused = sim.simulate(replace(rates, apply_s=0.0, transfer_s=1.2)).mean_period_s(5)
    assert paused > unpaused


def test_the_publish_stall_counts_as_idle():
    figures = sim.simulate(replace(BASE, max_offpolicy=1, publish_stall_s=1.0))
    assert figures.period_s == pytest.approx(4.0)
    assert figures.idle_share(skip=3) == pytest.approx(0.25)


def test_contention_is_read_from_component_times():
    serial = {"train_s": 3.0, "push_s": 1.6, "swap_s": 0.1}
    overlapped = {"train_s": 4.0, "serve_s": 2.1}
    train_c, push_c = sim.contention_from_runs(serial, overlapped)
    assert push_c == pytest.approx(2.0 / 1.5 - 1)
    assert train_c / (1 + train_c) == pytest.approx(1.0 / 2.0)
    # fed back, the simulator reproduces the overlapped train and serve times it was measured from
    rates = sim.LoopRates(3.0, 1.0, 1.5, 0.1, max_offpolicy=1, train_contention=train_c, push_contention=push_c)
    figures = sim.simulate(rates)
    assert figures.period_s == pytest.approx(4.0)
    assert figures.version_latency_s() == pytest.approx(2.1)


def _metrics(path: Path, train: float, push: float) -> None:
    path.mkdir(parents=True)
    lines = []
    for step in range(1, 6):
        lines.append(
            {
                "step": step,
                "time": step * (train + push),
                "perf/step_time": train + push,
                "perf/train_time": train,
                "perf/push_wait_time": push,
                "perf/weight_fetch_time": push - 0.1,
                "perf/weight_swap_time": 0.1,
                "perf/version_serve_time": push,
                "perf/train_wait_time": 0.0,
                "perf/rollout_time": 1.0,
            }
        )
    lines.insert(2, {"step": 2, "eval/reward": 0.5})  # lines without perf/step_time are not steps
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_a_measured_serial_run_is_predicted_from_its_own_medians(tmp_path):
    _metrics(tmp_path / "serial-0" / "run", train=3.0, push=1.5)
    _metrics(tmp_path / "overlapped-0" / "run", train=3.0, push=0.0)
    serial, _ = sim.load_pair(tmp_path)
    assert serial["period_s"] == pytest.approx(4.5) and serial["steps"] == 5
    rates = sim.rates_from_serial(serial)
    assert (rates.train_s, rates.transfer_s, rates.apply_s) == pytest.approx((3.0, 1.4, 0.1))
    assert sim.simulate(replace(rates, overlap=False)).period_s == pytest.approx(serial["period_s"])


def test_projection_cells_are_consistent():
    scale = sim.SCALES[0]
    fast = sim.project(scale, 1, 400)
    slow = sim.project(scale, 1, 100)
    serial = sim.project(scale, 0, 400)
    assert fast.rates.transfer_s == pytest.approx(2 * scale.params / 50e9)
    assert fast.figures.version_latency_s() < slow.figures.version_latency_s()
    assert serial.figures.mean_period_s(5) > fast.figures.mean_period_s(5)
    assert serial.figures.max_offset == 0 and fast.figures.max_offset <= 1
    today = sim.project(scale, 1, 400, path="today")
    assert today.rates.publish_stall_s > 10 * fast.rates.publish_stall_s
    assert today.trainer_host_gb > fast.trainer_host_gb
