"""A circuit breaker for rollout failures: trips when too large a share of recent rollouts failed.

A rollout function that keeps raising is a bug in user code, not bad luck; retrying it forever hides the bug and
burns inference. But real agentic rollouts fail a few percent of the time (tool errors, sandboxes), and failures
that happen before a rollout's first await resolve long before the successes started with them: judged in
completion order, 5 % of fast failures look like a run of failures at start-up. So outcomes are judged in the
order the rollouts *started*: the window holds the outcomes of the longest fully resolved prefix of started
rollouts (its last `window`), and the breaker trips when at least `min_attempts` are in it and the failure share
reaches `max_failure_rate`. A rollout function that always fails still trips after `min_attempts` rollouts.

    breaker = CircuitBreaker(window=100, min_attempts=20, max_failure_rate=0.5)
    ticket = breaker.start()          # when the rollout starts
    breaker.record(ok, "why", ticket=ticket)   # when it resolves; raises CircuitOpenError when it trips
    breaker.discard(ticket)                    # or: it resolved in a way that says nothing about the rollout function
"""

from __future__ import annotations

from collections import deque


class CircuitOpenError(RuntimeError):
    """Raised when the breaker trips; the message says why (with the last failure's error)."""


class CircuitBreaker:
    def __init__(self, window: int = 100, min_attempts: int = 20, max_failure_rate: float = 0.5) -> None:
        if window < 1 or not 1 <= min_attempts <= window or not 0 < max_failure_rate <= 1:
            raise ValueError(
                "circuit breaker: window >= 1, 1 <= min_attempts <= window and 0 < max_failure_rate <= 1; got "
                f"window={window}, min_attempts={min_attempts}, max_failure_rate={max_failure_rate}"
            )
        self.min_attempts = min_attempts
        self.max_failure_rate = max_failure_rate
        self.window: deque[bool] = deque(maxlen=window)
        self.reason: str | None = None
        self.last_failure = ""
        self._next_ticket = 0
        self._next_to_judge = 0  # every ticket below it is in the window (or has left it)
        self._resolved: dict[int, bool | None] = {}  # resolved out of start order (None: not judged)

    @property
    def is_open(self) -> bool:
        return self.reason is not None

    @property
    def in_flight(self) -> int:
        return self._next_ticket - self._next_to_judge - len(self._resolved)

    def start(self) -> int:
        """A rollout starts: its ticket (start order)."""
        ticket = self._next_ticket
        self._next_ticket += 1
        return ticket

    def discard(self, ticket: int) -> None:
        """A rollout that ended for a reason outside the rollout function (no inference replica to sample from
        during an outage): it leaves no outcome in the window, so an outage cannot trip the breaker."""
        self._resolved[ticket] = None
        self._advance()

    def _advance(self) -> None:
        while self._next_to_judge in self._resolved:
            ok = self._resolved.pop(self._next_to_judge)
            if ok is not None:
                self.window.append(ok)
            self._next_to_judge += 1

    def record(self, ok: bool, what: str = "", ticket: int | None = None) -> None:
        """Record one rollout's outcome (`ticket` from `start`; None = one that starts and resolves now).
        Raises `CircuitOpenError` when the breaker is (or this outcome makes it) open."""
        if ticket is None:
            ticket = self.start()
        if not ok and what:
            self.last_failure = what
        self._resolved[ticket] = ok
        self._advance()
        if self.reason is None and len(self.window) >= self.min_attempts:
            failures = self.window.count(False)
            if failures / len(self.window) >= self.max_failure_rate:
                self.reason = f"{failures} of the last {len(self.window)} rollouts failed"
                if self.last_failure:
                    self.reason += f" (last: {self.last_failure})"
        if self.reason is not None:
            raise CircuitOpenError(f"circuit breaker open: {self.reason}")
