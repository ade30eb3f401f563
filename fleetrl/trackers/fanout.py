"""`TrackerSet`: the trackers of a run, fed together, and what a tracker's failure (or slowness) does.

- At start (`make_trackers`, `log_config`) any failure raises `TrackerError`: a wrong W&B key, an unreachable
  MLflow server or a missing extra fails the run before it trains, not hours later.
- During the run the jsonl record is written at once, in the caller's thread, and its failure (disk full) raises:
  the run's own record cannot be lost silently. The other trackers are fed from one background thread, in order,
  so a slow or hung backend (an MLflow server retrying for minutes) never holds up the controller's event loop.
  Their failures (a network blip, a backend outage) are logged and counted (`failures`, exported as
  `trackers/failures` in each line and `fleetrl_controller_tracker_failures_total`), and the run goes on: a
  tracker never kills a healthy run. After `max_failures_in_a_row` failures in a row a tracker is switched off,
  with an error in the log; metrics.jsonl still has every step. A backlog beyond `max_pending` calls (a backend
  far slower than the steps) drops the newest calls, each counted as a failure of its tracker.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from fleetrl.trackers.base import Tracker, TrackerError

log = logging.getLogger(__name__)

MAX_FAILURES_IN_A_ROW = 20
MAX_PENDING = 10_000
CLOSE_TIMEOUT_S = 120.0  # how long the end of a run waits for the trackers' backlog before closing them


class TrackerSet:
    def __init__(
        self,
        trackers: Sequence[Tracker],
        max_failures_in_a_row: int = MAX_FAILURES_IN_A_ROW,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.trackers = list(trackers)
        self.max_failures_in_a_row = max_failures_in_a_row
        self.failures: dict[str, int] = {t.name: 0 for t in self.trackers}
        self._in_a_row: dict[str, int] = dict(self.failures)
        self.disabled: set[str] = set()
        self._pending: queue.Queue[tuple[Tracker | _Marker, str, tuple[Any, ...]] | None] = queue.Queue(max_pending)
        self._worker: threading.Thread | None = None

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    @property
    def total_failures(self) -> int:
        return sum(self.failures.values())

    def log_config(self, config: Mapping[str, Any]) -> None:
        """At start, in the caller's thread: a tracker that cannot take the config fails the run (`TrackerError`)."""
        for tracker in self.trackers:
            try:
                tracker.log_config(config)
            except Exception as exc:
                raise TrackerError(f"loggers: {tracker.name!r} could not log the config: {exc}") from exc

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._dispatch("log_metrics", step, dict(metrics))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self._dispatch("log_samples", step, [dict(r) for r in rows])

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every call handed to the background trackers is done; False if `timeout_s` ran out."""
        done = threading.Event()
        if self._worker is None:
            return True
        try:
            self._pending.put((_Marker(done), "", ()), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, failed: bool = False, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Finish the backlog (up to `timeout_s`), then close every tracker; one that fails to close is logged (the
        run's outcome is already decided)."""
        if not self.flush(timeout_s):
            log.error("trackers still busy after %.0f s at the end of the run: closing them anyway", timeout_s)
        if self._worker is not None:
            self._pending.put(None)
        for tracker in self.trackers:
            try:
                tracker.close(failed=failed)
            except Exception:
                self.failures[tracker.name] += 1
                log.exception("tracker %s failed to close", tracker.name)

    # --- dispatch --------------------------------------------------------------------------------
    def _dispatch(self, method: str, *args: Any) -> None:
        for tracker in self.trackers:
            if tracker.required:
                getattr(tracker, method)(*args)
            elif tracker.name not in self.disabled:
                self._start_worker()
                try:
                    self._pending.put_nowait((tracker, method, args))
                except queue.Full:
                    self._failed(tracker, method, RuntimeError(f"{self._pending.maxsize} calls are waiting"))

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="fleetrl-trackers", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while (item := self._pending.get()) is not None:
            tracker, method, args = item
            if isinstance(tracker, _Marker):
                tracker.done.set()
            elif tracker.name not in self.disabled:
                try:
                    getattr(tracker, method)(*args)
                except Exception as exc:
                    self._failed(tracker, method, exc)
                else:
                    self._in_a_row[tracker.name] = 0

    def _failed(self, tracker: Tracker, method: str, exc: Exception) -> None:
        self.failures[tracker.name] += 1
        self._in_a_row[tracker.name] += 1
        in_a_row = self._in_a_row[tracker.name]
        log.warning(
            "tracker %s: %s failed (%d in a row, %d in all); the run goes on: %s: %s",
            tracker.name,
            method,
            in_a_row,
            self.failures[tracker.name],
            type(exc).__name__,
            exc,
            exc_info=exc if in_a_row == 1 else None,  # the traceback once per streak
        )
        if in_a_row >= self.max_failures_in_a_row and tracker.name not in self.disabled:
            self.disabled.add(tracker.name)
            log.error(
                "tracker %s failed %d times in a row: switched off for the rest of the run (metrics.jsonl has "
                "every step)",
                tracker.name,
                in_a_row,
            )


class _Marker:
    """A queue entry that only says: everything before me is done."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done
        self.name = ""
