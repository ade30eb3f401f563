"""Prometheus metrics of the reference service (its own registry; see fleetrl.telemetry).

Names (prefix `fleetrl_reference_`): requests_total{outcome}, sequences_total, tokens_total,
forward_batches_total, forward_seconds (histogram), queue_depth, tokens_per_second.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FORWARD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ReferenceMetrics:
    def __init__(self, registry: CollectorRegistry, queue_depth: Callable[[], float], window_s: float = 10.0) -> None:
        prefix = "fleetrl_reference_"
        self.requests = Counter(
            prefix + "requests", "ComputeLogprobs calls by outcome (ok|invalid|error).", ["outcome"], registry=registry
        )
        self.sequences = Counter(prefix + "sequences", "Sequences scored.", registry=registry)
        self.tokens = Counter(prefix + "tokens", "Tokens scored (real, not padding).", registry=registry)
        self.batches = Counter(prefix + "forward_batches", "Forward passes run.", registry=registry)
        self.forward_seconds = Histogram(
            prefix + "forward_seconds", "Time of one batched forward.", buckets=_FORWARD_BUCKETS, registry=registry
        )
        Gauge(prefix + "queue_depth", "Requests waiting for a forward.", registry=registry).set_function(queue_depth)
        Gauge(prefix + "tokens_per_second", "Recent scoring throughput.", registry=registry).set_function(
            self.tokens_per_s
        )
        self._window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.totals = {"requests": 0, "sequences": 0, "tokens": 0, "batches": 0}

    def observe_forward(self, sequences: int, tokens: int, seconds: float) -> None:
        self.batches.inc()
        self.sequences.inc(sequences)
        self.tokens.inc(tokens)
        self.forward_seconds.observe(seconds)
        with self._lock:
            self.totals["batches"] += 1
            self.totals["sequences"] += sequences
            self.totals["tokens"] += tokens
            self._recent.append((time.monotonic(), tokens))

    def observe_request(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()
        if outcome == "ok":
            with self._lock:
                self.totals["requests"] += 1

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window_s
