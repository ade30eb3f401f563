"""Prometheus metrics of the inference server (one registry per server; see fleetrl.telemetry).

Metric names (all prefixed `fleetrl_inference_`): requests_total{api,outcome}, generated_tokens_total,
tokens_per_second, in_flight_requests, queue_depth, loaded_version, weight_loads_total{outcome},
weight_load_pause_seconds, weight_load_transfer_seconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleetrl.services.inference.engine import Completion, InferenceEngine, LoadResult

_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class InferenceMetrics:
    """The server's metrics; gauges that mirror engine state are read from it at scrape time."""

    def __init__(self, registry: CollectorRegistry, engine: InferenceEngine) -> None:
        self.registry = registry
        prefix = "fleetrl_inference_"
        self.requests = Counter(
            prefix + "requests",
            "Generate requests by API (grpc|completions|chat) and outcome (ok|invalid|error).",
            ["api", "outcome"],
            registry=registry,
        )
        self.generated_tokens = Counter(
            prefix + "generated_tokens", "Tokens generated (all completions).", registry=registry
        )
        self.in_flight = Gauge(prefix + "in_flight_requests", "Generate requests being served now.", registry=registry)
        self.weight_loads = Counter(
            prefix + "weight_loads",
            "LoadWeights calls by outcome (ok|rejected).",
            ["outcome"],
            registry=registry,
        )
        self.weight_load_pause = Histogram(
            prefix + "weight_load_pause_seconds",
            "Time generation was stopped for a weight swap.",
            buckets=_PAUSE_BUCKETS,
            registry=registry,
        )
        self.weight_load_transfer = Histogram(
            prefix + "weight_load_transfer_seconds",
            "Time to fetch and verify a weight version (generation continues meanwhile).",
            buckets=_TRANSFER_BUCKETS,
            registry=registry,
        )
        tokens_per_s = Gauge(prefix + "tokens_per_second", "Recent generation throughput.", registry=registry)
        tokens_per_s.set_function(lambda: engine.stats().tokens_per_s)
        queue_depth = Gauge(prefix + "queue_depth", "Sequences waiting or running in the engine.", registry=registry)
        queue_depth.set_function(engine.queue_depth)
        loaded_version = Gauge(
            prefix + "loaded_version", "Policy version being served (0 = initial).", registry=registry
        )
        loaded_version.set_function(lambda: engine.loaded_version)

    @asynccontextmanager
    async def track_request(self, api: str) -> AsyncIterator[None]:
        """Count one generate request for `api`, in flight while the block runs."""
        self.in_flight.inc()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        except ValueError:
            outcome = "invalid"
            raise
        finally:
            self.in_flight.dec()
            self.requests.labels(api=api, outcome=outcome).inc()

    def observe_completions(self, completions: list[Completion]) -> None:
        self.generated_tokens.inc(sum(len(c.token_ids) for c in completions))

    def observe_load(self, result: LoadResult | None) -> None:
        """Record a weight load (None = rejected)."""
        if result is None:
            self.weight_loads.labels(outcome="rejected").inc()
            return
        self.weight_loads.labels(outcome="ok").inc()
        self.weight_load_pause.observe(result.pause_s)
        self.weight_load_transfer.observe(result.transfer_s)
