"""A recipe written against the current Fireworks cookbook (fw-ai/cookbook #570) trains with its imports, model and
data changed: `fleetrl.cookbook.Config` with the recipe's fields (pipeline_chunks_per_step, tis=TISConfig(...),
anchor_logp, router_replay, save_final_checkpoint, cleanup_on_exit), a rollout that requires row_index /
sample_index / end_of_epoch and samples with `user=`, `RolloutSample(raw_logprobs=..., routing_matrices=None,
prompt_model_input=None)` segments in a `RolloutRun`, and `evaluation_fn(step, rollout_fn)`."""

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
from fleetrl import RolloutRun, RolloutSample, build_deployment_sampler
from fleetrl.cookbook import Config, TISConfig, main

seen = {"contexts": [], "eval_steps": []}


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)

    async def rollout_fn(sample_prompt, *, row_index, sample_index, end_of_epoch, evaluation=False):
        if not evaluation:
            seen["contexts"].append([row_index, sample_index, end_of_epoch])
        prompt = setup.tokenizer.encode(sample_prompt["prompt"])
        (c,) = await sampler.sample_with_prompt_tokens(
            prompt, n=1, user=f"row-{row_index}-{sample_index}", include_routing_matrix=False, **setup.sample_kwargs
        )
        n = len(c.inference_logprobs)
        reward = sum(1 for t in c.completion_tokens if t % 2 == 0) / max(n, 1)
        logprobs = [0.0] * c.prompt_len + c.inference_logprobs
        segment = RolloutSample(
            tokens=c.full_tokens, logprobs=logprobs, loss_mask=[0] * c.prompt_len + [1] * n, reward=reward,
            prompt_model_input=None, routing_matrices=None, raw_logprobs=logprobs,
        )
        return RolloutRun(segments=[segment])

    return rollout_fn


async def evaluation_fn(step, rollout_fn):
    seen["eval_steps"].append(step)
    run = await rollout_fn({"prompt": "count 1 to 3:"}, row_index=0, sample_index=0, end_of_epoch=False)
    return {"reward": run.segments[0].reward, "runs": 1.0}


if __name__ == "__main__":
    cfg = Config(
        **json.loads(sys.argv[1]),
        pipeline_chunks_per_step=2,
        tis=TISConfig(cap=2.0, level="token"),
        anchor_logp="old_policy",
        router_replay=False,
        router_replay_completion_only=True,
        save_final_checkpoint=True,
        cleanup_on_exit=True,
    )
    rows = [{"prompt": f"count {i} to {i + 3}:"} for i in range(4)]
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows, evaluation_fn=evaluation_fn, engine="hf",
                   startup_timeout_s=240)
    print("RESULT " + json.dumps({**summary, **seen}))
    sys.exit(summary["exit_code"])
"""


def test_a_current_cookbook_recipe_trains_with_imports_model_and_data_changed(tmp_path, tiny_model_dir):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    cfg = {
        "base_model": tiny_model_dir,
        "log_path": str(run_dir),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "learning_rate": 1e-4,
        "kl_beta": 0.0,
        "max_steps": 2,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(cfg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["steps"] == 2 and result["final_version"] == 2, result
    # The context keywords the rollout requires reached it: rows 0..3 (the last ends the epoch), samples 0..3.
    contexts = [tuple(c) for c in result["contexts"]]
    assert {r for r, _, _ in contexts} <= {0, 1, 2, 3} and {s for _, s, _ in contexts} == {0, 1, 2, 3}
    assert all(end == (r == 3) for r, _, end in contexts)
    # The cookbook-shaped hook ran every step (fleetrl.cookbook.main's evaluation_interval = 1), never failing.
    assert result["eval_steps"] and max(result["eval_steps"]) == 2
    evals = [m for m in read_metrics(run_dir) if any(k.startswith("eval/") for k in m)]
    assert evals and all("eval/failed" not in m for m in evals) and all(m.get("eval/runs") == 1.0 for m in evals)
    run = json.loads((run_dir / "run_config.json").read_text())["run"]
    assert (run["tis_cap"], run["loss_agg_mode"], run["stale_policy"], run["adam_beta2"]) == (2.0, "sum", "train", 0.95)
