"""A circuit breaker for rollout failures: trips after N consecutive failures or a failure rate over a window.

A rollout function that keeps raising is a bug in user code, not bad luck; retrying it forever hides the bug
and burns inference. Defaults: 5 in a row, or >= 50 % of the last 20 outcomes.
"""

from __future__ import annotations

from collections import deque


class CircuitOpenError(RuntimeError):
    """Raised when the breaker trips; the message says why."""


class CircuitBreaker:
    def __init__(self, max_consecutive: int = 5, window: int = 20, max_failure_rate: float = 0.5) -> None:
        if max_consecutive < 1 or window < 1 or not 0 < max_failure_rate <= 1:
            raise ValueError("circuit breaker: max_consecutive, window >= 1 and 0 < max_failure_rate <= 1")
        self.max_consecutive = max_consecutive
        self.max_failure_rate = max_failure_rate
        self.window: deque[bool] = deque(maxlen=window)
        self.consecutive = 0
        self.reason: str | None = None

    @property
    def is_open(self) -> bool:
        return self.reason is not None

    def record(self, ok: bool, what: str = "") -> None:
        """Record one outcome; raises `CircuitOpenError` when this outcome trips the breaker."""
        self.window.append(ok)
        self.consecutive = 0 if ok else self.consecutive + 1
        if self.reason is None:
            failures = self.window.count(False)
            full = len(self.window) == self.window.maxlen
            if self.consecutive >= self.max_consecutive:
                self.reason = f"{self.consecutive} consecutive rollout failures"
            elif full and failures / len(self.window) >= self.max_failure_rate:
                self.reason = f"{failures} of the last {len(self.window)} rollouts failed"
            if self.reason and what:
                self.reason += f" (last: {what})"
        if self.reason is not None:
            raise CircuitOpenError(f"circuit breaker open: {self.reason}")
