"""bench/gpu_check.py --dry-run: the GPU check's every check on CPU at tiny sizes (torchrun, a second process fetching
weights, the hf engine, `fleetrl up` of the arithmetic example), so the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_dry_run_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [c["check"] for c in report["checks"]] == [1, 2, 3, 4, 5, 6, 7]
    assert not report["failed"]
    assert all(c["status"] in ("ok", "not built") for c in report["checks"]), report["checks"]
    items = {(r["check"], r["item"].split(":")[0].split(" (")[0]) for r in report["rows"]}
    for expected in [
        (1, "fleetrl imports"),
        (1, "service entry points"),
        (2, "torchrun trainer binds its device"),
        (3, "largest micro-batch"),
        (4, "publish, first version"),
        (4, "publish, next version"),
        (4, "fetch_weights in a second process"),
        (5, "swap mid-generation"),
        (6, "fleetrl up, arithmetic, 2 steps"),
    ]:
        assert expected in items, (expected, sorted(items))
    assert sum(1 for r in report["rows"] if r["check"] == 7) == 2
    # The one table, printed and written.
    assert "| check | item | result | status | s |" in run.stdout
    assert (out / "gpu_check.md").read_text().count("\n| **") == 7
