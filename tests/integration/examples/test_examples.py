"""Every example's train.py runs end to end on the tiny model for 2 steps (real services, hf engine), and one
run.toml through `fleetrl up`. The tiny model writes random text, so rewards stay near their floor: these check that
the recipes run and report their metrics, not that they learn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
SMALL = ["--set", "completions_per_prompt=2", "--set", "prompt_groups_per_step=2", "--set", "max_completion_tokens=8"]
CASES = {
    "single_turn_token_in": (["--num-rows", "16"], "env/all/correct", (0.0, 1.0)),
    "multi_turn_message_in": (
        ["--num-rows", "16", "--max-turns", "2", "--set", "max_seq_len=384"],
        "env/all/turns",
        (1.0, 2.0),
    ),
    "gsm8k": (
        ["--data", str(EXAMPLES / "gsm8k" / "sample.jsonl"), "--set", "max_seq_len=256"],
        "env/all/format_ok",
        (0.0, 1.0),
    ),
    "tool_use": (["--num-rows", "16", "--tool-latency", "0.05"], "env/all/tool_error_frac", (0.0, 1.0)),
    # A Tinker env through fleetrl.tinker: its logging tag files the metrics under env/addition/.
    "tinker_env": (["--num-batches", "4"], "env/addition/reward/total", (0.0, 1.1)),
    # An unmodified OpenAI-SDK agent through agent sessions; exact_history joins its turns: one sample per trajectory.
    "openai_agent": (
        ["--set", "rollout_extras={max_turns = 3, exact_history = true}"],
        "env/all/session_turns",
        (2.0, 3.0),
    ),
}


def read_metrics(log_path: Path) -> list[dict]:
    """The training-step lines of metrics.jsonl (evaluation lines, if any, carry only eval/ figures)."""
    path = log_path / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [m for m in lines if "data/samples" in m]


@pytest.mark.parametrize("name", list(CASES))
def test_train_py_runs_two_steps(name, tiny_model_dir, tmp_path):
    extra, metric, (low, high) = CASES[name]
    log_path = tmp_path / "run"
    command = [sys.executable, str(EXAMPLES / name / "train.py"), "--model", tiny_model_dir, "--steps", "2"]
    # From another working directory: the recipe must not depend on where it is started.
    result = subprocess.run(
        [*command, "--log-path", str(log_path), *SMALL, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(log_path)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert low <= m[metric] <= high
        assert m["data/samples"] == 4
    if name == "tool_use":
        assert '"samples_per_s"' in result.stdout


def test_run_toml_runs_with_fleetrl_up(tiny_model_dir, tmp_path):
    sets = {
        "base_model": tiny_model_dir,
        "log_path": str(tmp_path / "run"),
        "max_steps": 2,
        "completions_per_prompt": 2,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
    }
    overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    config = EXAMPLES / "multi_turn_message_in" / "run.toml"
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(config), *overrides],
        cwd=REPO,  # run.toml's dataset path is relative to the repository root
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(1.0 <= m["env/all/turns"] <= 3.0 for m in metrics)
