"""The code task's reward: the share of a problem's unit tests that the model's program passes, run in fleetrl's
sandbox (fleetrl/sandbox.py: no network, none of the run's files or tokens, CPU, memory and process limits, killed
on a wall-clock limit).

The program goes in as `solution.py`; a small harness (`main.py`) imports it and runs each test in turn, printing
one JSON line with how many passed. A program that does not import, loops, allocates without bound or forks
scores 0 and the run goes on. The program shares the harness's interpreter, so it could forge that line: fine for
a toy task, not for a benchmark (run the checks in a second sandboxed call that reads only the first one's output).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fleetrl.sandbox import run_sandboxed

HARNESS = """
import json, sys
tests = json.loads(open("tests.json").read())
try:
    import solution
except BaseException as exc:
    print(json.dumps({"passed": 0, "total": len(tests), "error": repr(exc)[:200]}))
    sys.exit(0)
passed = 0
for test in tests:
    try:
        exec(test, dict(vars(solution)))
        passed += 1
    except BaseException:
        pass
print(json.dumps({"passed": passed, "total": len(tests)}))
"""

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(text: str) -> str:
    """The program in a reply: its first fenced block (```python ... ```), else the whole reply."""
    match = _FENCE.search(text)
    return match.group(1) if match else text


async def score_program(code: str, tests: list[str], **limits: Any) -> tuple[float, dict[str, Any]]:
    """(the share of `tests` that `code` passes, in [0, 1]; metrics). `limits` go to `run_sandboxed`."""
    options: dict[str, Any] = {"timeout_s": 10.0, "cpu_s": 5.0, "memory_mb": 256, "max_processes": 8, **limits}
    result = await run_sandboxed(
        HARNESS, files={"solution.py": code, "tests.json": json.dumps(tests)}, max_output_bytes=1 << 16, **options
    )
    report: dict[str, Any] = {}
    if result.ok:
        try:
            report = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            report = {}
    passed = int(report.get("passed", 0)) if isinstance(report, dict) else 0
    reward = passed / len(tests) if tests else 0.0
    metrics = {
        "tests_passed": float(passed),
        "program_imports": float("error" not in report and bool(report)),
        "sandbox_stopped": float(result.reason != "exited"),  # a limit or the wall clock ended it
    }
    return reward, metrics
