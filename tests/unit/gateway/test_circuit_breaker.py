"""The circuit breaker judges a failure rate over rollouts in start order, with a minimum count."""

import random

import pytest

from fleetrl.gateway.circuit_breaker import CircuitBreaker, CircuitOpenError


def run_batch(cb: CircuitBreaker, n: int, failing: set[int]) -> None:
    """n rollouts start together; the failing ones raise before their first await, so they resolve first (the
    completion order that fooled a 'consecutive failures' rule)."""
    tickets = [cb.start() for _ in range(n)]
    for i in sorted(failing):
        cb.record(False, "ToolError: sandbox died", ticket=tickets[i])
    for i in range(n):
        if i not in failing:
            cb.record(True, ticket=tickets[i])


@pytest.mark.parametrize("share", [0.05, 0.2, 0.4])
def test_a_share_of_fast_failures_does_not_trip(share):
    cb = CircuitBreaker()
    rng = random.Random(0)
    for _ in range(10):  # ten steps of P = 16 rows x G = 8 samples
        run_batch(cb, 128, {i for i in range(128) if rng.random() < share})
    assert not cb.is_open


def test_every_rollout_failing_trips_after_min_attempts_with_the_error():
    cb = CircuitBreaker(min_attempts=20)
    tickets = [cb.start() for _ in range(128)]
    for t in tickets[:19]:
        cb.record(False, "KeyError: 'question'", ticket=t)
    assert not cb.is_open
    with pytest.raises(CircuitOpenError, match=r"20 of the last 20 rollouts failed \(last: KeyError: 'question'\)"):
        cb.record(False, "KeyError: 'question'", ticket=tickets[19])
    with pytest.raises(CircuitOpenError):  # stays open
        cb.record(True, ticket=tickets[20])


def test_rate_over_the_window_trips_at_the_threshold():
    cb = CircuitBreaker(window=20, min_attempts=20, max_failure_rate=0.5)
    for i in range(19):
        cb.record(i % 2 == 0)  # 10 ok, 9 failures
    assert not cb.is_open
    with pytest.raises(CircuitOpenError, match="10 of the last 20"):
        cb.record(False)


def test_outcomes_wait_for_earlier_starts_and_bad_settings_are_refused():
    cb = CircuitBreaker(window=4, min_attempts=2, max_failure_rate=0.6)
    first, second = cb.start(), cb.start()
    cb.record(False, ticket=second)  # resolved out of order: not judged until the first resolves
    assert len(cb.window) == 0 and cb.in_flight == 1
    cb.record(True, ticket=first)
    assert list(cb.window) == [True, False] and not cb.is_open  # 1 of 2 < 0.6
    with pytest.raises(ValueError, match="min_attempts=30"):
        CircuitBreaker(window=20, min_attempts=30)


def test_discarded_rollouts_leave_no_outcome_and_do_not_hold_up_later_ones():
    # Rollouts that found no inference replica during an outage (a replica restarting) are not the rollout
    # function's failures: 30 of them in a row do not trip a breaker that trips at 20 failures.
    cb = CircuitBreaker(window=100, min_attempts=20, max_failure_rate=0.5)
    tickets = [cb.start() for _ in range(32)]
    for t in tickets[:30]:
        cb.discard(t)
    cb.record(True, ticket=tickets[31])
    assert len(cb.window) == 0 and cb.in_flight == 1  # the 31st still runs: the 32nd waits for it
    cb.record(False, "KeyError", ticket=tickets[30])
    assert list(cb.window) == [False, True] and not cb.is_open and cb.in_flight == 0
