"""bench/scale_check.py --dry-run: the second GPU check's eight items on CPU at tiny sizes (gloo for the one-rank
group, a child process for the dying receiver, `fleetrl up` of the arithmetic example), through the code the GPU run
takes, so the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Per item, a figure every dry run must measure (a positive number in some row's data).
FIGURES = {
    1: "tokens_per_s",
    2: "tokens_per_s",
    3: "stall_s",
    4: "apply_s",
    5: "gave_up_s",
    6: "loop_s",
    7: "saved_bytes_per_token",
    8: "waits",
}


def _positive(value: object) -> bool:
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int | float) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def test_dry_run_measures_every_item(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "bench/scale_check.py", "--dry-run", "--keep-going", "--out", str(out)]
    run = subprocess.run(
        [*argv, "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((out / "scale_check.json").read_text())
    assert [c["check"] for c in report["checks"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(c["status"] == "ok" for c in report["checks"]), report["checks"]
    assert not [r for r in report["rows"] if r["status"] == "FAIL"]
    for item, key in FIGURES.items():
        values = [r["data"][key] for r in report["rows"] if r["check"] == item and key in r["data"]]
        assert values and all(_positive(v) for v in values), (item, key, values)
    rows = {(r["check"], r["item"]) for r in report["rows"]}
    # Item 1: both micro-batch budgets, both sample lengths, and the checkpointing and compile arms.
    item1 = [r for r in report["rows"] if r["check"] == 1 and "tokens_per_s" in r["data"]]
    assert len(item1) >= 7 and all(r["data"]["mfu"] > 0 for r in item1)
    # Item 2: the one-rank group trains on DTensor shards to the world-size-1 loss.
    (pair,) = [r for r in report["rows"] if r["item"].startswith("loss, one-rank group")]
    assert abs(pair["data"]["diff"]) < 1e-4
    (sharded,) = [r for r in report["rows"] if r["item"] == "one-rank group (FSDP2 path)"]
    assert sharded["data"]["dtensor_params"] > 0
    # Item 4: every tensor arrived equal; item 5: the push failed (a dead receiver), the trainer's process lived.
    assert any("equal to the sender's: True" in r["result"] for r in report["rows"] if r["check"] == 4)
    (push,) = [r for r in report["rows"] if r["check"] == 5 and "gave_up_s" in r["data"]]
    assert push["data"]["ended"] and push["data"]["device_usable"] and push["data"]["error"]
    assert (8, "trainer idle per step (overlapped push on)") in rows
    # The one table, printed and written.
    assert "| check | item | result | status | s |" in run.stdout
    assert (out / "scale_check.md").read_text().count("\n| **") == 8
