"""The progress display of `fleetrl up`: reads metrics.jsonl as the controller appends to it.

On a terminal: a rich progress bar (steps done of the planned total, elapsed, ETA) with the numbers users watch
(reward, loss, KL, entropy, version offset, samples/s averaged over recent steps); evaluation lines print above it.
Elsewhere (a log file, a pipe, a test): one plain line per step, e.g.

    step 3/100  v3  reward 0.250  loss 0.01234  kl 0.001  entropy 1.234  offset 0.50/1  12.3 samples/s  eta 4m05s

Metric keys are read only through `fleetrl.metric_names`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fleetrl import metric_names as mn

WINDOW = 10  # steps the samples/s average and the ETA look back over


def fmt_duration(seconds: float | None) -> str:
    """'1h02m', '4m05s', '12s'; '?' when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _num(value: Any, digits: int, general: bool = False) -> str:
    """`value` with `digits` decimals (significant digits when `general`: a loss of 3e-06 is not 0.0000)."""
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.{digits}{'g' if general else 'f'}}"


def step_numbers(m: Mapping[str, Any], samples_per_s: float | None) -> str:
    """The per-step figures users watch, as one short text ('-' for a figure this run does not produce)."""
    kl = m.get(mn.KL_REFERENCE, m.get(mn.KL_SAMPLE_TRAIN))
    parts = [
        f"reward {_num(m.get(mn.RAW_REWARD), 3)}",
        f"loss {_num(m.get(mn.LOSS), 4, general=True)}",
        f"kl {_num(kl, 4, general=True)}",
        f"entropy {_num(m.get(mn.ENTROPY), 3)}",
        f"offset {_num(m.get(mn.OFFSET_MEAN), 2)}/{_num(m.get(mn.OFFSET_MAX), 0)}",
        f"{_num(samples_per_s, 1)} samples/s",
    ]
    return "  ".join(parts)


def eta_seconds(step_times: Iterable[float], step: int, total: int | None) -> float | None:
    """Seconds left at `step` of `total`, from the mean interval between the recent steps' end times."""
    times = list(step_times)
    if not total or len(times) < 2:
        return None
    per_step = (times[-1] - times[0]) / (len(times) - 1)
    return max(total - step, 0) * per_step


def planned_steps(run: Any) -> int | None:
    """A run `Config`'s total steps: max_steps, else what its dataset gives (rows, at most max_rows, x epochs / rows
    per step; a mixture's sources summed, before any difficulty filter), else None (rows given in code, an
    unreadable file)."""
    if run.max_steps:
        return int(run.max_steps)
    paths = [run.dataset] if run.dataset else [source.path for source in getattr(run, "datasets", None) or []]
    counts = [count_rows(path) for path in paths]
    if not counts or not all(counts):
        return None
    rows = sum(min(n, run.max_rows) if run.max_rows else n for n in counts if n)
    return max(rows * run.epochs // run.prompt_groups_per_step, 1)


def count_rows(path: str) -> int | None:
    """Rows in a JSONL (non-empty lines) or Parquet (its metadata) dataset; None when it cannot be read."""
    try:
        if path.lower().endswith(".parquet"):
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except (OSError, ImportError, ValueError):
        return None


class Progress:
    def __init__(self, metrics_path: Path, max_steps: int | None, stream: Any = None, from_end: bool = False) -> None:
        """`max_steps`: the planned total (`planned_steps`), None when unknown. `from_end`: show only lines written
        from now on. A resumed run's controller first cuts the record back to the resumed version (the file is
        replaced, so reading starts over, skipping lines older than this), then appends."""
        self.path = metrics_path
        self.max_steps = max_steps
        self.stream = stream or sys.stdout
        self.since = time.time() if from_end else None
        self.offset = metrics_path.stat().st_size if from_end and metrics_path.exists() else 0
        self.inode = metrics_path.stat().st_ino if metrics_path.exists() else None
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last: dict[str, Any] = {}
        self.rates: deque[float] = deque(maxlen=WINDOW)
        self.step_times: deque[float] = deque(maxlen=WINDOW + 1)
        self._bar: Any = None
        self._task: Any = None

    def _start_bar(self, completed: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress
        from rich.text import Text

        class TwoLines(RichProgress):  # the bar, then the numbers on their own line (they fit an 80-column terminal)
            def get_renderables(self) -> Any:
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text(f"  v{task.fields['version']}  {task.fields['numbers']}")

        self._bar = TwoLines(
            TextColumn("[bold]train"),
            BarColumn(bar_width=30),
            MofNCompleteColumn() if self.max_steps else TextColumn("step {task.completed}"),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            console=Console(file=self.stream),
            redirect_stdout=self.stream is sys.stdout,
            redirect_stderr=self.stream is sys.stdout,
        )
        fields = {"eta": "?", "version": 0, "numbers": ""}
        self._task = self._bar.add_task("train", total=self.max_steps, completed=completed, **fields)
        self._bar.start()

    def update(self, final: bool = False) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            if final:
                self.close()
            return
        if stat.st_ino != self.inode or stat.st_size < self.offset:  # replaced (cut back at a resume): start over
            self.inode, self.offset = stat.st_ino, 0
        with open(self.path, encoding="utf-8") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete, _, _rest = chunk.rpartition("\n")
        if complete:
            self.offset += len(complete.encode()) + 1
            for line in complete.splitlines():
                record = json.loads(line)
                if self.since is not None and record.get("time", self.since) < self.since:
                    continue  # a line of the run before this resume
                self._show(record)
        if final:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _show(self, m: dict[str, Any]) -> None:
        evals = {k.removeprefix("eval/"): v for k, v in m.items() if k.startswith("eval/") and k != "eval/seconds"}
        if evals:  # an evaluation line: its own line, kept on screen
            text = "  ".join(f"{k} {v:.3f}" for k, v in sorted(evals.items()) if isinstance(v, int | float))
            self._print(f"eval of version {m.get(mn.VERSION, 0)}: {text}")
            return
        self.last = m
        step = int(m.get(mn.STEP, 0))
        if isinstance(rate := m.get(mn.SAMPLES_PER_S), int | float):
            self.rates.append(float(rate))
        self.step_times.append(float(m.get("time", time.time())))
        samples_per_s = sum(self.rates) / len(self.rates) if self.rates else None
        numbers = step_numbers(m, samples_per_s)
        eta = fmt_duration(eta_seconds(self.step_times, step, self.max_steps))
        version = m.get(mn.VERSION, 0)
        if not self.tty:
            total = f"/{self.max_steps}" if self.max_steps else ""
            self._print(f"step {step}{total}  v{version}  {numbers}  eta {eta}")
            return
        if self._bar is None:
            self._start_bar(completed=step - 1)
        self._bar.update(self._task, completed=step, eta=eta, version=version, numbers=numbers)

    def note(self, text: str) -> None:
        """A line of its own above the bar (or among the step lines): a warning the user should see."""
        self._print(text)

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()
