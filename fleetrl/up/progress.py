"""The progress line of `fleetrl up`: reads metrics.jsonl as the controller appends to it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class Progress:
    def __init__(self, metrics_path: Path, max_steps: int | None, stream: Any = None, from_end: bool = False) -> None:
        """`from_end`: show only lines written from now on. A resumed run's controller first cuts the record back to
        the resumed version (the file is replaced, so reading starts over, skipping lines older than this), then
        appends."""
        self.path = metrics_path
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self.since = time.time() if from_end else None
        self.offset = metrics_path.stat().st_size if from_end and metrics_path.exists() else 0
        self.inode = metrics_path.stat().st_ino if metrics_path.exists() else None
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last: dict[str, Any] = {}

    def update(self, final: bool = False) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return
        if stat.st_ino != self.inode or stat.st_size < self.offset:  # replaced (cut back at a resume): start over
            self.inode, self.offset = stat.st_ino, 0
        with open(self.path, encoding="utf-8") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete, _, _rest = chunk.rpartition("\n")
        if not complete:
            return
        self.offset += len(complete) + 1
        for line in complete.splitlines():
            record = json.loads(line)
            if self.since is not None and record.get("time", self.since) < self.since:
                continue  # a line of the run before this resume
            self.last = record
            self._show(record)
        if final and self.tty:
            self.stream.write("\n")

    def _show(self, m: dict[str, Any]) -> None:
        evals = {k.removeprefix("eval/"): v for k, v in m.items() if k.startswith("eval/") and k != "eval/seconds"}
        if evals:  # an evaluation line: its own line, kept on screen
            text = "  ".join(f"{k} {v:.3f}" for k, v in sorted(evals.items()))
            self.stream.write(("\n" if self.tty else "") + f"eval of version {m.get('version', 0)}: {text}\n")
            self.stream.flush()
            return
        step = m.get("step", 0)
        total = self.max_steps
        bar = ""
        if total:
            done = int(20 * min(step, total) / total)
            bar = f"[{'#' * done}{'.' * (20 - done)}] "
        text = (
            f"{bar}step {step}{'/' + str(total) if total else ''}  v{m.get('version', 0)}  "
            f"reward {m.get('reward/mean', float('nan')):.3f}  "
            f"offset {m.get('async/version_offset_mean', 0):.2f}/{m.get('async/version_offset_max', 0)}  "
            f"{m.get('perf/step_samples_per_s', 0):.1f} samples/s  {time.monotonic() - self.start:.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + text.ljust(100))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
