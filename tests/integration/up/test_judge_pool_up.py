"""A rollout scores through the judge pool under `fleetrl up` (issue 32 part 3): examples/judge on the tiny model
with a judge of other weights (same tokenizer) in a pool of two frozen replicas. The example's rollout awaits the
judge's answer for every sample and raises without a judge pool, so trained steps carrying its metrics mean the
judge answered; the judges run as their own processes (judge-<i>.log) and the controller never lists them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.tiny_model import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "judge" / "run.toml"


def test_a_rollout_scores_through_the_judge_pool(tiny_model_dir, tmp_path):
    judge = str(build_tiny_model(tmp_path / "judge", seed=5))
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
        "up.judge_model": judge,
        "up.judge_replicas": 2,
    }
    overrides = [a for k, v in values.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(CONFIG), *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    lines = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "data/samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["env/all/judged"] <= 1.0 and "env/all/judge_correct" in m  # the judge's verdicts
    for i in range(2):
        log = (log_path / f"judge-{i}.log").read_text()
        assert f"--model {judge}" in log and "serve inference" in log
    controller = (log_path / "controller.log").read_text().splitlines()[0]
    assert controller.count("--inference") == 1  # the policy replica only: the judges are never sent weights
