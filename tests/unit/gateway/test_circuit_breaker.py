import pytest

from fleetrl.gateway.circuit_breaker import CircuitBreaker, CircuitOpenError


def test_trips_after_five_consecutive_failures():
    cb = CircuitBreaker()
    for _ in range(4):
        cb.record(False)
    assert not cb.is_open
    with pytest.raises(CircuitOpenError, match="5 consecutive"):
        cb.record(False, "ZeroDivisionError")
    assert "ZeroDivisionError" in cb.reason


def test_trips_at_half_of_last_twenty():
    cb = CircuitBreaker()
    for i in range(19):
        cb.record(i % 2 == 0)  # 10 ok, 9 failures, never 5 in a row
    assert not cb.is_open
    with pytest.raises(CircuitOpenError, match="10 of the last 20"):
        cb.record(False)


def test_successes_keep_it_closed():
    cb = CircuitBreaker()
    for i in range(100):
        cb.record(i % 4 != 0)  # 25 % failures
    assert not cb.is_open
