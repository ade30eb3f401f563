"""Prometheus metrics of the policy trainer (its own registry; see fleetrl.telemetry).

Every per-step figure of `StepResult.metrics` is a gauge named `fleetrl_trainer_<name>` with the name's
non-alphanumerics as underscores: train/loss -> fleetrl_trainer_train_loss, optim/grad_norm, optim/entropy,
train/clip_frac, optim/ppo_kl, train/kl_ref, perf/tokens_per_s -> fleetrl_trainer_perf_tokens_per_s,
rollout/filtered_reward, ... (the keys are listed in docs/metrics.md).
Also: steps_total, version, published_version, buffered_groups, and the group stream's counters:
groups_received_total, samples_received_total, samples_dropped_total{field}, messages_dropped_total{reason},
groups_duplicate_total.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "fleetrl_trainer_"
_SKIP = {"step", "version"}  # exported as their own gauges, read from the trainer


def metric_name(key: str) -> str:
    """`perf/fwd_bwd_time` -> `fleetrl_trainer_perf_fwd_bwd_time`."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


class _StreamCollector(Collector):
    """The group stream's counters, read at scrape time."""

    def __init__(
        self,
        counts: Callable[[], Mapping[str, int]],
        duplicates: Callable[[], int],
        superseded: Callable[[], int],
        refused_full: Callable[[], int],
        evicted_unclaimed: Callable[[], int],
    ) -> None:
        self._counts = counts
        self._duplicates = duplicates
        self._superseded = superseded
        self._refused_full = refused_full
        self._evicted_unclaimed = evicted_unclaimed

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._counts()
        yield CounterMetricFamily(
            PREFIX + "groups_received", "Rollout groups received and buffered.", value=counts.get("groups", 0)
        )
        yield CounterMetricFamily(
            PREFIX + "samples_received", "Valid samples received.", value=counts.get("samples", 0)
        )
        dropped = CounterMetricFamily(
            PREFIX + "samples_dropped", "Invalid samples dropped on arrival, by field.", labels=["field"]
        )
        messages = CounterMetricFamily(
            PREFIX + "messages_dropped", "Whole messages dropped (malformed, auth, handler).", labels=["reason"]
        )
        for key, value in sorted(counts.items()):
            if key.startswith("samples_dropped/"):
                dropped.add_metric([key.split("/", 1)[1]], value)
            elif key.startswith("messages_dropped/"):
                messages.add_metric([key.split("/", 1)[1]], value)
        yield dropped
        yield messages
        yield CounterMetricFamily(
            PREFIX + "groups_duplicate",
            "Groups refused because their row was already buffered or trained.",
            value=self._duplicates(),
        )
        yield CounterMetricFamily(
            PREFIX + "groups_superseded",
            "Groups evicted or refused because the controller superseded their attempt (stale, expired, failed).",
            value=self._superseded(),
        )
        yield CounterMetricFamily(
            PREFIX + "groups_refused_full",
            "Groups evicted to make room because the buffer was full (max_buffered_groups): a flood of stray groups.",
            value=self._refused_full(),
        )
        yield CounterMetricFamily(
            PREFIX + "groups_evicted_unclaimed",
            "Buffered groups no step named for 4 x (O + 2) steps (stray or forged groups), evicted.",
            value=self._evicted_unclaimed(),
        )


class TrainerMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        version: Callable[[], float],
        published_version: Callable[[], float],
        buffered_groups: Callable[[], float],
        stream_counts: Callable[[], Mapping[str, int]],
        duplicates: Callable[[], int],
        superseded: Callable[[], int] = lambda: 0,
        refused_full: Callable[[], int] = lambda: 0,
        evicted_unclaimed: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = registry
        self.steps = Counter(PREFIX + "steps", "Optimizer batches trained.", registry=registry)
        Gauge(PREFIX + "version", "Policy version (optimizer batches done).", registry=registry).set_function(version)
        Gauge(
            PREFIX + "published_version", "Last version on the weight stream (-1: none).", registry=registry
        ).set_function(published_version)
        Gauge(PREFIX + "buffered_groups", "Groups received, not yet trained.", registry=registry).set_function(
            buffered_groups
        )
        registry.register(_StreamCollector(stream_counts, duplicates, superseded, refused_full, evicted_unclaimed))
        self._gauges: dict[str, Gauge | None] = {}

    def observe_step(self, metrics: Mapping[str, float]) -> None:
        self.steps.inc()
        for key, value in metrics.items():
            if key in _SKIP:
                continue
            name = metric_name(key)
            if name in self._gauges and self._gauges[name] is None:
                continue
            gauge = self._gauges.get(name)
            if gauge is None:
                try:
                    gauge = Gauge(name, f"Last step's {key}.", registry=self.registry)
                except ValueError:  # the name is taken by one of the fixed metrics above
                    logger.warning("step metric %r clashes with metric %s; not exported", key, name)
                    self._gauges[name] = None
                    continue
                self._gauges[name] = gauge
            if gauge is not None:
                gauge.set(value)
