"""Which steps a resumed controller must write into the run's record, and the line it writes for one.

Every trained step appears exactly once in `metrics.jsonl` and `samples.jsonl`. A controller killed while the
trainer trained a step never heard back about it: the trainer checkpointed it, the resumed journal counts its rows
as trained (`RowScheduler.align_to_trainer`), and neither file has it. Killed between a step's journal entry and its
line (a serial weight push comes between), the same. So at a resume, once the record is cut back to the trainer's
version, the controller asks the trainer for the result of each recent step the record lacks (a TrainStep for a
step already trained answers with its result again: `fleetrl.trainer.step_records`) and writes what is missing.

The files themselves say what is missing, not the journal: a controller killed again halfway through this finds the
lines it wrote and writes only the rest, so no step is written twice. Pure: the orchestrator reads the files and
calls the trainer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fleetrl import metric_names as mn
from fleetrl.sample_log import samples_due

RECOVERY_WINDOW = 4
"""How many of the newest steps are checked: the journal is at most one step behind the trainer and a step's line
is written right after its reply, so only the last step or two can lack one (the trainer keeps as many results,
fleetrl.trainer.step_records.RECORDS_KEPT)."""

RECOVERED = "record/recovered"
"""Set to 1 on a line written at a resume from the trainer's record of the step: the trainer's figures are the
step's, the controller's timings of it were lost with the controller that ran it, so the line has none."""


def steps_to_recover(
    version: int,
    line_steps: Iterable[int],
    sample_steps: Iterable[int],
    samples_interval: int,
    window: int = RECOVERY_WINDOW,
) -> list[int]:
    """The steps up to `version` (of the newest `window`) whose metrics line is missing (not in `line_steps`) or
    whose samples are due (`samples_interval`) and missing (not in `sample_steps`), in order."""
    lines, samples = set(line_steps), set(sample_steps)
    return [
        step
        for step in range(max(1, version - window + 1), version + 1)
        if step not in lines or (samples_due(step, samples_interval) and step not in samples)
    ]


def recovered_line(
    trainer_metrics: Mapping[str, float],
    *,
    step: int,
    version: int,
    time: float,
    done_frac: float,
    counters: Mapping[str, int],
) -> dict[str, Any]:
    """A step's line rebuilt from the trainer's record of it: the trainer's figures (losses, rewards, the trained
    samples' version offsets), step, version, time, `progress/done_frac`, the scheduler's counters as
    `producer/<name>` (as they are at the resume) and `record/recovered` = 1; no `perf/*` timings of the
    controller's."""
    line: dict[str, Any] = {**trainer_metrics, "step": step, "version": version, "time": time}
    line[mn.PROGRESS_DONE_FRAC] = done_frac
    for key, value in counters.items():
        line[f"producer/{key}"] = value
    line[RECOVERED] = 1
    return line


def steps_in_samples(path: Path) -> set[int]:
    """The steps that have samples in a samples.jsonl (a line cut short by a crash counts for none)."""
    if not path.exists():
        return set()
    steps = set()
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            steps.add(int(json.loads(text)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def cut_torn_tail(path: Path) -> str | None:
    """Remove a last line cut short by a crash or a full disk (no newline at its end and not JSON) from a JSONL
    record, so the record can be read and the step written again (`steps_to_recover`); returns the removed text,
    None when the file ends whole. Atomic (the file is replaced). A bad line that ends with its newline is damage,
    not a torn write: it is left for the reader to name."""
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text or text.endswith("\n"):
        return None
    head, _, tail = text.rpartition("\n")
    try:
        json.loads(tail)
        return None  # whole, only its newline missing: kept
    except ValueError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(head + "\n" if head else "", encoding="utf-8")
    os.replace(tmp, path)
    return tail
