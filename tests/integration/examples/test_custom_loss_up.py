"""examples/custom_loss under `fleetrl up` on the tiny model: the trainer imports the loss named by import path from
the config's folder and trains two steps with it (its own metric, train/stale_frac, reaches metrics.jsonl); a path
naming nothing stops the trainer at start with a message naming policy_loss."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "custom_loss" / "run.toml"


def _up(tiny_model_dir: str, tmp_path: Path, **sets: object) -> tuple[subprocess.CompletedProcess[str], Path]:
    rows = tmp_path / "rows.jsonl"
    rng = random.Random(0)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(16)]
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    log_path = tmp_path / "run"
    values = {
        "base_model": tiny_model_dir,
        "dataset": str(rows),
        "eval_dataset": str(rows),
        "evaluation_interval": 0,
        "log_path": str(log_path),
        "max_steps": 2,
        "lr_warmup_steps": 0,
        "completions_per_prompt": 2,
        "prompt_groups_per_step": 2,
        **sets,
    }
    overrides = [a for k, v in values.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(CONFIG), *overrides],
        cwd=tmp_path,  # the loss is found through the config's folder, not the working directory
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, log_path


def test_the_example_loss_trains_under_fleetrl_up(tiny_model_dir, tmp_path):
    result, log_path = _up(tiny_model_dir, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    lines = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "data/samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["train/stale_frac"] <= 1.0  # the custom loss's own metric: it ran in the trainer


def test_a_loss_path_naming_nothing_stops_the_trainer_at_start(tiny_model_dir, tmp_path):
    result, log_path = _up(tiny_model_dir, tmp_path, policy_loss="my_losses:missing_loss")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "policy_loss 'my_losses:missing_loss': module 'my_losses' has no attribute 'missing_loss'" in output
    assert not (log_path / "metrics.jsonl").exists() or "data/samples" not in (log_path / "metrics.jsonl").read_text()
