"""`AutoSteps`: the trainer's own step coordinator for `--auto-steps` (no controller): a step whenever P groups are
buffered, in arrival order, until max_steps, then the final checkpoint and export.

It runs in one background thread and calls the service's blocking operations (`train_step`, `finish`), which take
the training lock, so a Status call or a stop by signal never sees half a step. A failure is kept in `failed` (the
service's `check()` turns it into health NOT_SERVING and exit code 1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetrl.trainer.buffer import GroupBuffer, GroupRef

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How long one wait for P groups lasts before the stop flag is looked at again."""


class AutoSteps:
    """Trains step `steps_done() + 1` from the first P buffered groups, again and again, until `stop` is set or
    `max_steps` is reached (then `finish()` once)."""

    def __init__(
        self,
        buffer: GroupBuffer,
        *,
        groups_per_step: int,
        max_steps: int | None,
        steps_done: Callable[[], int],
        train_step: Callable[[int, list[GroupRef]], Any],
        finish: Callable[[], tuple[Path, Path]],
        stop: threading.Event,
    ) -> None:
        self._buffer = buffer
        self._groups_per_step = groups_per_step
        self._max_steps = max_steps
        self._steps_done = steps_done
        self._train_step = train_step
        self._finish = finish
        self._stop = stop
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="fleetrl-auto-steps", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def run(self) -> None:
        """The loop itself (the thread's target); returns at stop, at max_steps, or on a failure."""
        try:
            while not self._stop.is_set():
                if self._max_steps is not None and self._steps_done() >= self._max_steps:
                    ckpt, export = self._finish()
                    logger.info("auto steps: max_steps reached; checkpoint %s, export %s", ckpt, export)
                    return
                groups = self._buffer.wait_for_count(self._groups_per_step, timeout_s=POLL_S)
                if len(groups) < self._groups_per_step:
                    continue
                self._train_step(self._steps_done() + 1, [(*g.key, g.lease_tag) for g in groups])
        except Exception as exc:  # surfaced: health goes NOT_SERVING and the service exits non-zero
            logger.exception("auto-step loop failed")
            self.failed = exc
