"""The README's main job at toy scale: warm start, then `fleetrl up examples/arithmetic/run.toml` with evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_warm_start_then_fleetrl_up_with_evaluation(tmp_path):
    init = tmp_path / "init"
    warm = subprocess.run(
        [sys.executable, "examples/arithmetic/warm_start.py", "--out", str(init), "--steps", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "held-out greedy accuracy" in warm.stdout
    assert (init / "model" / "config.json").exists() and (init / "eval.jsonl").exists()
    run_dir = tmp_path / "run"
    sets = {
        "base_model": f'"{init / "model"}"',
        "dataset": f'"{init / "train.jsonl"}"',
        "eval_dataset": f'"{init / "eval.jsonl"}"',
        "log_path": f'"{run_dir}"',
        "max_steps": "2",
        "prompt_groups_per_step": "2",
        "completions_per_prompt": "4",
        "evaluation_interval": "1",
        "lr_warmup_steps": "0",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    up = subprocess.run(
        [sys.executable, "-m", "fleetrl.cli", "up", "examples/arithmetic/run.toml", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval/accuracy" in m]
    steps = [m for m in lines if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # Evaluated before any rollout (version 0) and at the end on the final weights (version 2); the mid-run one
    # (version 1) runs unless version 2 is already due when the evaluator gets to it (it is then superseded).
    versions = [m["version"] for m in evals]
    assert versions[0] == 0 and versions[-1] == 2 and set(versions) <= {0, 1, 2} and versions == sorted(versions)
    assert all(0.0 <= m["eval/accuracy"] <= 1.0 and "eval/failed" not in m for m in evals)
    plot = subprocess.run([sys.executable, "-m", "fleetrl.cli", "plot", str(run_dir)], cwd=REPO, capture_output=True)
    assert plot.returncode == 0 and (run_dir / "curves.png").stat().st_size > 10_000
