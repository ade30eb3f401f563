"""One step's metrics line (a line of `log_path/metrics.jsonl` and of every tracker), built from what the step
produced: the trainer's figures, the step's timings, the groups the gateways rejected since the previous step and
the scheduler's counters. Pure: the orchestrator gathers the inputs and writes the line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetrl import metric_names as mn
from fleetrl.step_metrics import reward_filter_metrics


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step: `wait` (the trainer idle before it, waiting for rollouts), `train` (the TrainStep
    call), `weight_update` (the push to every replica), `total` (from TrainStep to the end of the push),
    `fetch` and `swap` (the slowest replica's fetch-and-verify while it kept generating, and its pause for the
    swap), `gate_open` (from the TrainStep reply until the gate admits rows at the new version), `push_wait` (the
    trainer idle waiting for a push: the whole push when pushes are serial, else only drains before an evaluation
    or the end) and `version_serve` (publish to served by every replica, of the newest version served since the last
    step line; None when none was)."""

    wait: float
    train: float
    weight_update: float
    total: float
    fetch: float = 0.0
    swap: float = 0.0
    gate_open: float = 0.0
    push_wait: float = 0.0
    version_serve: float | None = None


def perf_metrics(times: StepTimes, samples: float, tokens: float) -> dict[str, float]:
    """`perf/*`: the step's wall time is the wait plus the step itself; rates are over that wall time."""
    step_time = times.wait + times.total
    return {
        "perf/step_time": step_time,
        "perf/train_time": times.train,
        "perf/train_wait_time": times.wait,
        "perf/wait_time_ratio": times.wait / step_time if step_time > 0 else 0.0,
        "perf/weight_update_time": times.weight_update,
        "perf/weight_fetch_time": times.fetch,
        "perf/weight_swap_time": times.swap,
        "perf/gate_open_time": times.gate_open,
        "perf/push_wait_time": times.push_wait,
        mn.SAMPLES_PER_S: samples / step_time if step_time > 0 else 0.0,
        "perf/step_tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
    }


def step_line(
    trainer_metrics: Mapping[str, float],
    *,
    step: int,
    version: int,
    time: float,
    admitted_offsets: Sequence[int],
    rejected_rewards: Sequence[float],
    rejected_groups: int,
    done_frac: float,
    times: StepTimes,
    counters: Mapping[str, int],
    tracker_failures: int,
    row_phases: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The step's line: the trainer's metrics, then step/version/time, the admitted offsets, the reward-filter
    figures (fleetrl.step_metrics.reward_filter_metrics), `progress/done_frac`, `perf/*` (with the gateways'
    per-row phase means, `row_phases`, from fleetrl.controller.row_phases), every scheduler counter as
    `producer/<name>` and the trackers' failures so far.

    `async/version_offset_*` come from the trainer (measured on the samples it trained, per-token versions); the
    offsets the controller admitted the groups at (`admitted_offsets`) are kept apart as
    `async/admitted_offset_max`: they must never be larger."""
    line: dict[str, Any] = {**trainer_metrics, "step": step, "version": version, "time": time}
    line["async/admitted_offset_max"] = max(admitted_offsets or (0,))
    line.update(reward_filter_metrics(trainer_metrics, rejected_rewards, rejected_groups))
    line[mn.PROGRESS_DONE_FRAC] = done_frac
    line.update(perf_metrics(times, trainer_metrics.get("data/samples", 0.0), trainer_metrics.get("data/tokens", 0.0)))
    if times.version_serve is not None:
        line["perf/version_serve_time"] = times.version_serve
    line.update(row_phases or {})
    for key, value in counters.items():
        line[f"producer/{key}"] = value
    line[mn.TRACKER_FAILURES] = tracker_failures
    return line
