"""A Tinker env (written here, on fleetrl.tinker's stand-in classes) trained by `fleetrl.main` on the tiny model:
group rewards see the whole group, logging tags file metrics under env/<tag>/, and main() returns its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.up.conftest import REPO, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, sys
from fleetrl import Config, main
from fleetrl.tinker import Env, EnvGroupBuilder, ModelInput, StepResult, tinker_rollout_fn


class EchoEnv(Env):
    def __init__(self, tokenizer, prompt):
        self.tokenizer, self.prompt = tokenizer, prompt

    async def initial_observation(self):
        return ModelInput.from_ints(self.tokenizer.encode(self.prompt)), ["\\n"]

    async def step(self, action, *, extra=None):
        return StepResult(0.0, True, ModelInput.from_ints([]), [], {"action_tokens": float(len(action))})


class RankBuilder(EnvGroupBuilder):
    def __init__(self, tokenizer, prompt, n):
        self.tokenizer, self.prompt, self.n = tokenizer, prompt, n

    async def make_envs(self):
        return [EchoEnv(self.tokenizer, self.prompt) for _ in range(self.n)]

    async def compute_group_rewards(self, trajectory_group, env_group):
        texts = [self.tokenizer.decode(t.transitions[0].ac.tokens) for t in trajectory_group]
        order = sorted(range(len(texts)), key=lambda i: texts[i])  # a reward only the whole group can give
        rank = {i: r for r, i in enumerate(order)}
        return [(rank[i] / len(texts), {"group_seen": float(len(texts))}) for i in range(len(texts))]

    def logging_tags(self):
        return ["toy"]


def make_rollout_fn(setup):
    return tinker_rollout_fn(
        setup, lambda row: RankBuilder(setup.tokenizer, row["prompt"], setup.completions_per_prompt)
    )


if __name__ == "__main__":
    cfg = Config(**json.loads(sys.argv[1]))
    rows = [{"prompt": f"count {i} to {i + 3}:"} for i in range(8)]
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows, engine="hf", startup_timeout_s=240)
    print("SUMMARY " + json.dumps(summary))
    sys.exit(summary["exit_code"])
"""


def test_a_tinker_env_trains_with_group_rewards_and_tagged_metrics(tmp_path, tiny_model_dir):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    cfg = {
        "base_model": tiny_model_dir,
        "log_path": str(run_dir),
        "completions_per_prompt": 3,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 6,
        "max_seq_len": 64,
        "kl_beta": 0.0,
        "max_steps": 2,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, str(script), json.dumps(cfg)]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    assert (summary["exit_code"], summary["steps"], summary["final_version"]) == (0, 2, 2)
    assert summary["final_model"] == str(run_dir / "final")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # compute_group_rewards saw all 3 trajectories of each row, once per row.
        assert m["env/toy/group_seen"] == 3.0 and m["env/all/group_seen"] == 3.0
        assert 0.0 <= m["env/toy/reward/total"] <= 1.0 and m["data/samples"] == 6
    assert summary["last_metrics"]["step"] == 2
