"""Prometheus metrics of the controller, read from the scheduler and registry at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class ControllerMetrics(Collector):
    """Exports fleetrl_controller_* gauges and counters (names documented in docs/metrics.md)."""

    def __init__(self, registry: CollectorRegistry, scheduler: Any, members: Any, orchestrator: Any) -> None:
        self.scheduler, self.members, self.orchestrator = scheduler, members, orchestrator
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        import time

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
        offsets = self.orchestrator.last_metrics.get("async/version_offset_max", 0.0)
        yield GaugeMetricFamily(
            "fleetrl_controller_version_offset_max", "Last step's max version offset.", value=offsets
        )
        rows = CounterMetricFamily("fleetrl_controller_rows", "Row outcomes by kind.", labels=["outcome"])
        for key, value in s.counters.items():
            if key.startswith("rows_"):
                rows.add_metric([key.removeprefix("rows_")], value)
        yield rows
        now = time.time()
        lag = GaugeMetricFamily(
            "fleetrl_controller_replica_version_lag", "Live version minus the replica's.", labels=["replica"]
        )
        fenced = GaugeMetricFamily("fleetrl_controller_replica_fenced", "1 if fenced.", labels=["replica"])
        for m in self.members.alive("inference", now):
            lag.add_metric([m.member_id], s.gate.version - m.version)
            fenced.add_metric([m.member_id], int(m.fenced))
        yield lag
        yield fenced
