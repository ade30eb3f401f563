"""`<log_path>/metrics.jsonl`, the run's record: one JSON line per trained step (`step`, `version`, the trainer's
and the controller's metrics) and one per evaluation (`eval/*` keys, `step` = `version` = the evaluated version).

The record holds exactly one line per step. A resumed run retrains the steps its trainer's checkpoint had not
seen, so at resume the controller cuts the record back to the trainer's version (`cut_to_version`): the lines
of later steps and evaluations of later versions move to `metrics.superseded.jsonl` next to it, and the retrained
steps' lines take their place. Readers (`fleetrl plot`) also keep only the last line of a step, so a record
written before this rule still shows one curve.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fleetrl.metric_names import EMPTY_STEP

SUPERSEDED = "metrics.superseded.jsonl"


def is_eval(line: dict[str, Any]) -> bool:
    return any(key.startswith("eval/") for key in line)


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a metrics.jsonl in file order; a line that is not JSON raises ValueError naming it."""
    lines = []
    for n, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON: {exc.msg}") from None
    return lines


def one_per_step(lines: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step lines, evaluation lines), each sorted by step, the last line of a step (or version) winning: a
    retrained step supersedes the line of the attempt that was lost."""
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for line in lines:
        (evals if is_eval(line) else steps)[int(line.get("step", 0))] = line
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def split_at_version(lines: list[dict[str, Any]], version: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, superseded): the lines of steps and evaluations up to `version`, in file order, each step's last
    line only; and the rest (later steps, evaluations of later versions, earlier lines of a step)."""
    last_index: dict[tuple[bool, int], int] = {}
    for i, line in enumerate(lines):
        last_index[(is_eval(line), int(line.get("step", 0)))] = i
    kept, superseded = [], []
    for i, line in enumerate(lines):
        key = (is_eval(line), int(line.get("step", 0)))
        (kept if key[1] <= version and last_index[key] == i else superseded).append(line)
    return kept, superseded


def cut_to_version(path: Path, version: int) -> int:
    """Make the record at `path` end at `version` (a resume from the trainer's checkpoint of that version): later
    lines move to `metrics.superseded.jsonl` beside it. Atomic (the file is replaced). Returns how many moved."""
    if not path.exists():
        return 0
    kept, superseded = split_at_version(read_lines(path), version)
    if not superseded:
        return 0
    with open(path.with_name(SUPERSEDED), "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in superseded)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
    os.replace(tmp, path)
    return len(superseded)


def steps_without_update(path: Path, up_to: int) -> int:
    """How many of steps 1..`up_to` in the record were empty (no trainable group: the trainer's `train/empty_step`)."""
    if not path.exists():
        return 0
    steps, _ = one_per_step(read_lines(path))
    return sum(1 for line in steps if 0 < int(line.get("step", 0)) <= up_to and line.get(EMPTY_STEP))
