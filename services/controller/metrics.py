"""Prometheus metrics of the controller, read from the scheduler and registry at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fleetrl.controller.step_sums import StepSums

# Last step's figures from the orchestrator's metrics line: (metric, metrics.jsonl key, help).
_STEP_GAUGES = (
    ("version_offset_max", "async/version_offset_max", "Last step's max version offset."),
    ("version_offset_mean", "async/version_offset_mean", "Last step's mean version offset."),
    ("step_seconds", "perf/step_time", "Last step's wall time (wait for rollouts + train + weight push)."),
    ("train_seconds", "perf/train_time", "Last step's TrainStep call (trainer busy)."),
    ("train_wait_seconds", "perf/train_wait_time", "Trainer idle before the last step, waiting for rollouts."),
    ("weight_update_seconds", "perf/weight_update_time", "Last step's weight push to every replica."),
    ("weight_fetch_seconds", "perf/weight_fetch_time", "Last push: the slowest replica's fetch and checksum."),
    ("weight_swap_seconds", "perf/weight_swap_time", "Last push: the longest a replica paused to swap."),
    ("gate_open_seconds", "perf/gate_open_time", "Last step: TrainStep reply until the gate admits the new version."),
    ("row_rollout_seconds", "perf/rollout_time", "Last step's rows: mean seconds of a row's group of rollouts."),
    ("row_lease_seconds", "perf/lease_time", "Last step's rows: mean seconds of the LeaseRows call that leased them."),
    ("row_send_seconds", "perf/group_send_time", "Last step's rows: mean seconds sending a group to the trainer."),
    ("samples_per_second", "perf/samples_per_s", "Samples trained per second over the last step."),
    ("tokens_per_second", "perf/step_tokens_per_s", "Tokens trained per second over the last step."),
)


def rollout_queue_depth(scheduler: Any) -> int:
    """Rows a gateway could lease right now and none has: the gate admits them and the data still has them.

    Persistently above zero means the gateways are the bottleneck (the metric the gateway autoscaler uses).
    """
    gate = scheduler.gate
    rows = max(gate.capacity(), 0) // gate.group_size  # the gate admits whole rows of G samples
    if scheduler.max_steps is not None:
        rows = min(rows, max(scheduler._row_budget() - scheduler._rows_committed(), 0))
    cursor = scheduler.cursor
    return min(rows, len(scheduler.queue) + max(cursor.total_rows - cursor.consumed, 0))


def step_sum_counters(sums: StepSums) -> Iterator[CounterMetricFamily]:
    """Counters of every step's learning-curve figures (fleetrl.controller.step_sums): the dashboard draws
    (rate(sum{sign="positive"}) - rate(sum{sign="negative"})) / rate(count), which no short step escapes."""
    yield CounterMetricFamily("fleetrl_controller_steps", "Steps this controller recorded.", value=sums.steps)
    count = CounterMetricFamily(
        "fleetrl_controller_step_value_count", "Steps that reported the metric.", labels=["metric"]
    )
    total = CounterMetricFamily(
        "fleetrl_controller_step_value_sum",
        "Sum over steps of the metric's positive values (sign=positive) or of the negative ones' magnitudes "
        "(sign=negative).",
        labels=["metric", "sign"],
    )
    for key, n in sums.count.items():
        count.add_metric([key], n)
        total.add_metric([key, "positive"], sums.positive[key])
        total.add_metric([key, "negative"], sums.negative[key])
    yield count
    yield total


class ControllerMetrics(Collector):
    """Exports fleetrl_controller_* gauges and counters (names documented in docs/metrics.md)."""

    def __init__(self, registry: CollectorRegistry, scheduler: Any, members: Any, orchestrator: Any) -> None:
        self.scheduler, self.members, self.orchestrator = scheduler, members, orchestrator
        self.started_at = time.time()
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        s = self.scheduler
        yield GaugeMetricFamily("fleetrl_controller_version", "Live policy version.", value=s.gate.version)
        yield GaugeMetricFamily("fleetrl_controller_trained_steps", "Steps trained.", value=s.trained_steps)
        yield GaugeMetricFamily("fleetrl_controller_max_offpolicy_versions", "The bound O.", value=s.max_offpolicy)
        yield GaugeMetricFamily("fleetrl_controller_rows_in_flight", "Rows leased.", value=len(s.leases))
        yield GaugeMetricFamily(
            "fleetrl_controller_rows_queued", "Rows waiting to be leased again.", value=len(s.queue)
        )
        yield GaugeMetricFamily(
            "fleetrl_controller_gate_capacity", "Samples the gate admits now.", value=s.gate.capacity()
        )
        yield GaugeMetricFamily(
            "fleetrl_controller_rollout_queue_depth",
            "Rows the gate admits now that no gateway has leased yet.",
            value=rollout_queue_depth(s),
        )
        last = self.orchestrator.last_metrics
        for name, key, help_text in _STEP_GAUGES:
            yield GaugeMetricFamily(f"fleetrl_controller_{name}", help_text, value=last.get(key, 0.0))
        yield GaugeMetricFamily(
            "fleetrl_controller_last_step_timestamp_seconds",
            "Unix time the last step ended (the controller's start before the first step).",
            value=last.get("time", self.started_at),
        )
        rows = CounterMetricFamily("fleetrl_controller_rows", "Row outcomes by kind.", labels=["outcome"])
        for key, value in s.counters.items():
            if key.startswith("rows_"):
                rows.add_metric([key.removeprefix("rows_")], value)
        yield rows
        yield CounterMetricFamily(
            "fleetrl_controller_late_reports",
            "Reports from a gateway whose lease had expired (ignored).",
            value=s.counters.get("late_reports", 0),
        )
        yield from step_sum_counters(self.orchestrator.step_sums)
        now = time.monotonic()  # the registry's clock (liveness runs on the monotonic clock)
        members = GaugeMetricFamily("fleetrl_controller_members", "Live members by kind.", labels=["kind"])
        for kind in ("gateway", "inference", "trainer"):
            members.add_metric([kind], len(self.members.alive(kind, now)))
        yield members
        lag = GaugeMetricFamily(
            "fleetrl_controller_replica_version_lag", "Live version minus the replica's.", labels=["replica"]
        )
        fenced = GaugeMetricFamily("fleetrl_controller_replica_fenced", "1 if fenced.", labels=["replica"])
        for m in self.members.alive("inference", now):
            lag.add_metric([m.member_id], s.gate.version - m.version)
            fenced.add_metric([m.member_id], int(m.fenced))
        yield lag
        yield fenced
        trackers = CounterMetricFamily(
            "fleetrl_controller_tracker_failures",
            "Failed calls to an experiment tracker (W&B, TensorBoard, MLflow); the run goes on.",
            labels=["tracker"],
        )
        tracker_set = getattr(self.orchestrator, "trackers", None)
        for name, count in tracker_set.failures.items() if tracker_set is not None else ():
            trackers.add_metric([name], count)
        yield trackers
