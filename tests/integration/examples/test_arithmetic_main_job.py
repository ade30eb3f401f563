"""The README's main job, at full scale: the warm start, then `fleetrl up examples/arithmetic/run.toml` with its
own settings (only the paths point into a temporary folder). The held-out accuracy must rise clearly, as the
README states; the margins are about half the rise measured on this machine, so a run that learns passes and one
that does not (a broken update, weights that never reach inference) fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def warm_started(tmp_path_factory) -> Path:
    """The README's warm start, once for both arms."""
    init = tmp_path_factory.mktemp("arithmetic") / "init"
    warm = subprocess.run(
        [sys.executable, "examples/arithmetic/warm_start.py", "--out", str(init)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "held-out greedy accuracy" in warm.stdout
    return init


# The README's two arms: full fine-tuning with run.toml as shipped, and LoRA (rank 16, lr 1e-3) with the README's
# `--set` flags. A LoRA run pushes only the adapter and computes its reference without a reference service.
ARMS = {"full": {}, "lora": {"lora_rank": "16", "learning_rate": "1e-3"}}


@pytest.mark.parametrize("arm", list(ARMS))
def test_main_job_learns(tmp_path, warm_started, arm):
    init = warm_started
    run_dir = tmp_path / "run"
    sets = {
        **ARMS[arm],
        "base_model": f'"{init / "model"}"',
        "dataset": f'"{init / "train.jsonl"}"',
        "eval_dataset": f'"{init / "eval.jsonl"}"',
        "log_path": f'"{run_dir}"',
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    up = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", "examples/arithmetic/run.toml", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "rollout/raw_reward" in m]
    evals = [m for m in lines if "eval/accuracy" in m]
    assert [m["step"] for m in steps] == list(range(1, 101))
    assert all(m["async/version_offset_max"] <= 1 for m in steps)
    # Evaluated before any rollout (version 0) and at the end on the final weights (version 100); mid-run
    # evaluations may be superseded when steps outpace the evaluator.
    versions = [m["version"] for m in evals]
    assert versions[0] == 0 and versions[-1] == 100 and versions == sorted(versions)
    assert all("eval/failed" not in m for m in evals)
    first, last = evals[0], evals[-1]
    assert last["eval/sampled_accuracy"] >= first["eval/sampled_accuracy"] + 0.15, (first, last)
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.15, (first, last)
    train_start = sum(m["rollout/raw_reward"] for m in steps[:10]) / 10
    train_end = sum(m["rollout/raw_reward"] for m in steps[-10:]) / 10
    assert train_end >= train_start + 0.1, (train_start, train_end)
    plot = subprocess.run([sys.executable, "-m", "fleetrl", "plot", str(run_dir)], cwd=REPO, capture_output=True)
    assert plot.returncode == 0 and (run_dir / "curves.png").stat().st_size > 10_000
    adapter = run_dir / "final" / "adapter_config.json"
    assert adapter.exists() == (arm == "lora"), sorted(p.name for p in (run_dir / "final").iterdir())
