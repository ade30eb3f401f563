"""What a tracker's failure does: the record's failure fails the run, another tracker's is logged, counted and
survived (switched off after too many in a row), and any failure at start fails the start."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from fleetrl.trackers import TrackerError, TrackerSet
from fleetrl.trackers.base import Tracker


class _Recording(Tracker):
    """Keeps what it is given; fails the calls named in `fail` (a scripted fake)."""

    def __init__(self, name: str, fail: Sequence[str] = (), required: bool = False, fail_times: int = 10**9) -> None:
        self.name, self.required = name, required
        self.fail, self.fail_times = set(fail), fail_times
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.samples: list[tuple[int, list[Any]]] = []
        self.closed: list[bool] = []

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail and self.fail_times > 0:
            self.fail_times -= 1
            raise ConnectionError(f"{self.name} {what} is down")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._maybe_fail("log_config")

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._maybe_fail("log_metrics")
        self.metrics.append((step, dict(metrics)))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self._maybe_fail("log_samples")
        self.samples.append((step, list(rows)))

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


def test_a_failing_tracker_is_counted_and_the_others_still_get_every_step(caplog):
    record, flaky = _Recording("jsonl", required=True), _Recording("wandb", fail=["log_metrics"], fail_times=2)
    trackers = TrackerSet([record, flaky])
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            trackers.log_metrics(step, {"step": step})
        assert trackers.flush(timeout_s=30)
    assert [s for s, _ in record.metrics] == [1, 2, 3]
    assert [s for s, _ in flaky.metrics] == [3]  # it came back
    assert trackers.failures == {"jsonl": 0, "wandb": 2} and trackers.total_failures == 2
    assert "tracker wandb: log_metrics failed (2 in a row, 2 in all); the run goes on" in caplog.text
    assert not trackers.disabled


def test_a_tracker_failing_too_often_in_a_row_is_switched_off(caplog):
    dead = _Recording("mlflow", fail=["log_metrics", "log_samples"])
    trackers = TrackerSet([_Recording("jsonl", required=True), dead], max_failures_in_a_row=3)
    with caplog.at_level(logging.ERROR):
        for step in range(1, 6):
            trackers.log_metrics(step, {"step": step})
        assert trackers.flush(timeout_s=30)
    assert trackers.failures["mlflow"] == 3 and trackers.disabled == {"mlflow"}
    assert "tracker mlflow failed 3 times in a row: switched off" in caplog.text
    trackers.log_samples(6, [{"step": 6}])
    assert trackers.flush(timeout_s=30)
    assert trackers.failures["mlflow"] == 3  # not called any more


def test_the_record_failing_fails_the_run():
    trackers = TrackerSet([_Recording("jsonl", fail=["log_metrics"], required=True), _Recording("wandb")])
    with pytest.raises(ConnectionError, match="jsonl log_metrics is down"):
        trackers.log_metrics(1, {"step": 1})


def test_a_tracker_that_cannot_take_the_config_fails_the_start():
    trackers = TrackerSet([_Recording("jsonl", required=True), _Recording("tensorboard", fail=["log_config"])])
    with pytest.raises(TrackerError, match="loggers: 'tensorboard' could not log the config"):
        trackers.log_config({"seed": 0})


def test_close_reaches_every_tracker_even_after_one_fails():
    class _BadClose(_Recording):
        def close(self, failed: bool = False) -> None:
            raise ConnectionError("gone")

    last = _Recording("mlflow")
    trackers = TrackerSet([_BadClose("wandb"), last])
    trackers.close(failed=True)
    assert last.closed == [True] and trackers.failures["wandb"] == 1


def test_a_hung_tracker_does_not_hold_up_the_record():
    entered, release = threading.Event(), threading.Event()

    class _Hung(_Recording):
        def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
            entered.set()
            release.wait(30)  # a backend retrying for minutes
            super().log_metrics(step, metrics)

    record, hung = _Recording("jsonl", required=True), _Hung("mlflow")
    trackers = TrackerSet([record, hung], max_pending=3)
    trackers.log_metrics(1, {"step": 1})
    assert entered.wait(30)
    for step in range(2, 6):
        trackers.log_metrics(step, {"step": step})  # returns at once: the record has every step
    assert [s for s, _ in record.metrics] == [1, 2, 3, 4, 5]
    assert not trackers.flush(timeout_s=0.2)
    release.set()
    assert trackers.flush(timeout_s=30)
    # Step 1 was in the worker's hands, 2-4 waited (max_pending 3), step 5 found the backlog full: dropped, counted.
    assert [s for s, _ in hung.metrics] == [1, 2, 3, 4] and trackers.failures["mlflow"] == 1
