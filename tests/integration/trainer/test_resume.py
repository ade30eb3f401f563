"""Kill-and-resume through the real command line: a process trains 3 steps and checkpoints; a fresh process
started with --resume trains 2 more; the weights equal a straight 5-step run (same seed, deterministic CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.rollout_group import write_groups_jsonl
from tests.unit.trainer.helpers import tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_TOML = """\
base_model = "{model}"
completions_per_prompt = 4
prompt_groups_per_step = 2
max_completion_tokens = 16
max_seq_len = 64
learning_rate = 1e-3
lr_schedule = "cosine"
lr_warmup_steps = 2
num_minibatches = 2
policy_loss = "ppo"
kl_beta = 0.0
seed = 3
"""


def _train(toml, groups, log_path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "fleetrl", "serve", "trainer", "--config", str(toml), "--standalone", str(groups)]
    cmd += ["--set", f'log_path="{log_path}"', "--total-steps", "5", "--no-metrics", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _steps(log_path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_exactly_like_a_straight_run(tiny_model_dir, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML.format(model=tiny_model_dir))
    groups = tmp_path / "groups.jsonl"
    write_groups_jsonl(groups, tiny_groups(tiny_model_dir, num_groups=10))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(toml, groups, straight, "--set", "max_steps=5", "--set", "log_samples_interval=2")
    _train(toml, groups, resumed, "--set", "max_steps=3")  # the process ends here; only the checkpoint remains
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    _train(toml, groups, resumed, "--set", "max_steps=5", "--resume")

    steps_straight, steps_resumed = _steps(straight), _steps(resumed)
    assert [s["step"] for s in steps_resumed] == [1, 2, 3, 4, 5]  # the second process began at step 4
    for a, b in zip(steps_straight, steps_resumed, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=1e-7)
        assert a["optim/lr"] == pytest.approx(b["optim/lr"], rel=1e-9)
    weights_a = load_file(straight / "final" / "model.safetensors")
    weights_b = load_file(resumed / "final" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name, value in weights_a.items():
        torch.testing.assert_close(weights_b[name], value, atol=1e-6, rtol=1e-5, msg=name)
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    assert not torch.equal(base["lm_head.weight"], weights_a["lm_head.weight"])
    # The run folder's record as under a controller: the config and, every 2 steps, decoded samples.
    assert json.loads((straight / "config.json").read_text())["log_samples_interval"] == 2
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [2, 4] and all(s["completion"] for s in samples)
    state = json.loads((resumed / "checkpoints" / "step-00000005" / "trainer_state.json").read_text())
    assert (
        state["data_position"]["groups_consumed"] == 10 and sum(e - s for s, e in state["trained_rows"]["ranges"]) == 10
    )
