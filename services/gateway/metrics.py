"""Prometheus metrics of a gateway, read from its counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class GatewayMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, gateway: Any) -> None:
        self.gateway = gateway
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        counters = self.gateway.counters
        rollouts = CounterMetricFamily("fleetrl_gateway_rollouts", "Rollout calls by result.", labels=["result"])
        for result in ("ok", "failed", "retried"):
            rollouts.add_metric([result], counters.get(f"rollouts_{result}", 0))
        yield rollouts
        dropped = CounterMetricFamily(
            "fleetrl_gateway_samples_dropped", "Samples dropped by reason.", labels=["reason"]
        )
        for reason in ("none", "error", "invalid", "too_long"):
            dropped.add_metric([reason], counters.get(f"samples_dropped_{reason}", 0))
        yield dropped
        rows = CounterMetricFamily("fleetrl_gateway_rows", "Rows by outcome.", labels=["outcome"])
        for outcome in ("accepted", "rejected", "failed"):
            rows.add_metric([outcome], counters.get(f"rows_{outcome}", 0))
        yield rows
        yield CounterMetricFamily(
            "fleetrl_gateway_row_seconds",
            "Lease-to-report seconds summed over rows.",
            value=self.gateway.row_seconds_sum,
        )
        yield CounterMetricFamily("fleetrl_gateway_rows_done", "Rows reported.", value=counters.get("rows_done", 0))
        # The judge pool ([up] judge_model): this gateway's calls to it; 0 without a judge, as every counter here
        # exists from the start (a series that appears only sometimes breaks rate() and the docs' check).
        judge = getattr(self.gateway, "judge_sampler", None)
        yield CounterMetricFamily(
            "fleetrl_gateway_judge_calls",
            "Generate calls to the judge pool.",
            value=judge.calls if judge is not None else 0,
        )
        yield CounterMetricFamily(
            "fleetrl_gateway_judge_retries",
            "Judge calls retried on another judge replica.",
            value=judge.retries if judge is not None else 0,
        )
        sampler = getattr(self.gateway, "sampler", None)
        bad = CounterMetricFamily(
            "fleetrl_gateway_replica_bad_replies",
            "Generate replies refused as impossible, by inference replica.",
            labels=["replica"],
        )
        counts = dict(getattr(sampler, "bad_replies", {}))
        for address in getattr(sampler, "replicas", ()):  # 0 for every replica in use: the series exist from the start
            counts.setdefault(address, 0)
        for address, count in sorted(counts.items()):
            bad.add_metric([address], count)
        yield bad
        yield GaugeMetricFamily(
            "fleetrl_gateway_circuit_open",
            "1 when the circuit breaker is open.",
            value=int(self.gateway.breaker.is_open),
        )
