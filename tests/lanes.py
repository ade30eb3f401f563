"""CI's two lanes run the suite once between them: a check of what each lane collected and selected.

`.ci/run` runs the fast lane (`-m "not slow"`) and then the slow lane (`-m slow`), each with `FLEETRL_LANE_RECORD`
naming a file; the hooks below (imported by tests/conftest.py) write the node ids the lane selected and those its
`-m` deselected. Then

    python -m tests.lanes fast.json slow.json

fails unless both lanes collected the same tests and each test ran in exactly one lane (none twice, none left out:
a test marked neither `slow` nor not is in the fast lane by construction; this catches lanes that drift apart, e.g.
a path or `-k` added to one of them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

RECORD_ENV = "FLEETRL_LANE_RECORD"

_deselected: list[str] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(item.nodeid for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        # Under pytest-xdist every worker collects the whole lane (the same record) and writes it: whole files only.
        record = {"selected": [item.nodeid for item in session.items], "deselected": list(_deselected)}
        tmp = Path(f"{path}.{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


def lane_problems(lanes: dict[str, dict[str, list[str]]]) -> list[str]:
    """What is wrong with these lanes' records (name -> {"selected", "deselected"}): empty when every test collected
    was selected by exactly one lane and every lane collected the same tests."""
    problems = []
    collected = {name: set(r["selected"]) | set(r["deselected"]) for name, r in lanes.items()}
    everything = set().union(*collected.values())
    for name, tests in collected.items():
        if tests != everything:
            problems.append(f"lane {name} did not collect {sorted(everything - tests)[:10]}")
    runs: dict[str, list[str]] = {}
    for name, record in lanes.items():
        for nodeid in record["selected"]:
            runs.setdefault(nodeid, []).append(name)
    twice = {nodeid: names for nodeid, names in runs.items() if len(names) > 1}
    if twice:
        problems.append(f"{len(twice)} tests run in more than one lane, e.g. {sorted(twice.items())[:10]}")
    left_out = sorted(everything - set(runs))
    if left_out:
        problems.append(f"{len(left_out)} tests run in no lane, e.g. {left_out[:10]}")
    return problems


def main(paths: list[str]) -> int:
    lanes = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    problems = lane_problems(lanes)
    for problem in problems:
        print(f"lanes: {problem}", file=sys.stderr)
    if not problems:
        counts = ", ".join(f"{name} {len(r['selected'])}" for name, r in lanes.items())
        print(f"lanes: every test in exactly one lane ({counts})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
