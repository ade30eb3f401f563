"""`fleetrl eval`: the run's evaluation hook on its held-out rows against one model, through a real replica."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.up.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write_config(tmp_path, model_dir, up):
    rows = tmp_path / "eval.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(6)))
    run = {
        "base_model": model_dir,
        "eval_dataset": str(rows),
        "log_path": str(tmp_path / "run"),
        "max_completion_tokens": 4,
        "max_seq_len": 32,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": run, "up": {"rollout": "unused:make", "engine": "hf", **up}}))
    return path


def fleetrl_eval(*args):
    return subprocess.run(
        [sys.executable, "-m", "fleetrl", "eval", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_prints_the_hooks_metrics_for_a_model(tmp_path, tiny_model_dir):
    hook = str(REPO / "examples" / "arithmetic" / "rollout.py") + ":evaluate"
    config = write_config(tmp_path, tiny_model_dir, {"evaluation": hook})
    out = tmp_path / "eval.json"
    result = fleetrl_eval(config, "--model", tiny_model_dir, "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics == json.loads(out.read_text())
    assert metrics["model"] == tiny_model_dir
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.0 <= metrics["sampled_accuracy"] <= 1.0
    assert (tmp_path / "run" / "eval" / "inference.log").exists()


def test_eval_names_what_is_wrong(tmp_path, tiny_model_dir):
    no_hook = fleetrl_eval(write_config(tmp_path, tiny_model_dir, {}))
    assert no_hook.returncode == 2 and "up.evaluation" in no_hook.stderr
    hook = "tests.integration.up.rollouts:broken_evaluate"
    broken = fleetrl_eval(write_config(tmp_path, tiny_model_dir, {"evaluation": hook}))
    assert broken.returncode == 1
    assert "evaluation failed: RuntimeError: the grader is down" in broken.stderr


HOOKS = """
def make_rollout_fn(setup):
    async def rollout_fn(row, *, evaluation=False):
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        return {"evaluation": evaluation, "tokens": len(c.completion_tokens)}

    return rollout_fn


async def evaluation_fn(step, rollout_fn):
    results = [await rollout_fn({"prompt": f"{a}+{a}="}) for a in range(2)]
    tokens = sum(r["tokens"] for r in results)
    return {"step": step, "evaluation": all(r["evaluation"] for r in results), "tokens": tokens}
"""


def test_eval_runs_a_cookbook_shaped_hook_with_the_runs_rollout_function(tmp_path, tiny_model_dir):
    # The current cookbook's evaluation_fn(step, rollout_fn): no eval_dataset; it gets step 0 and the [up] rollout
    # factory's function, called with evaluation=True.
    (tmp_path / "hooks.py").write_text(HOOKS)
    run = {"base_model": tiny_model_dir, "log_path": str(tmp_path / "run"), "max_completion_tokens": 4}
    up = {"rollout": "hooks.py:make_rollout_fn", "evaluation": "hooks.py:evaluation_fn", "engine": "hf"}
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"run": run, "up": up}))
    result = fleetrl_eval(config)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert (metrics["step"], metrics["evaluation"]) == (0.0, 1.0) and metrics["tokens"] >= 2


JUDGE_HOOKS = """
def make_rollout_fn(setup):
    if setup.judge_sampler is None:
        raise RuntimeError("no judge pool")

    async def rollout_fn(row, *, evaluation=False):
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        (verdict,) = await setup.judge_sampler.sample_with_prompt_tokens(c.full_tokens, n=1, max_tokens=2)
        return {"judged": len(verdict.completion_tokens) > 0, "url": setup.judge_base_url, "model": setup.judge_model}

    return rollout_fn


async def evaluation_fn(step, rollout_fn):
    results = [await rollout_fn({"prompt": f"{a}+{a}="}) for a in range(3)]
    return {
        "judged": sum(r["judged"] for r in results),
        "url": all(r["url"].startswith("http://127.0.0.1:") and r["url"].endswith("/v1") for r in results),
    }
"""


def test_eval_starts_the_judge_pool_for_the_runs_rollout(tmp_path, tiny_model_dir):
    """[up] judge_model under `fleetrl eval`: the judge pool starts as under `fleetrl up` (judge_replicas frozen
    replicas of the judge, judge-<i>.log), and the rollout factory's setup has its sampler and OpenAI base URL."""
    from fleetrl.tiny_model import build_tiny_model

    judge = str(build_tiny_model(tmp_path / "judge", seed=5))
    (tmp_path / "hooks.py").write_text(JUDGE_HOOKS)
    run = {"base_model": tiny_model_dir, "log_path": str(tmp_path / "run"), "max_completion_tokens": 4}
    up = {
        "rollout": "hooks.py:make_rollout_fn",
        "evaluation": "hooks.py:evaluation_fn",
        "engine": "hf",
        "judge_model": judge,
        "judge_replicas": 2,
    }
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"run": run, "up": up}))
    result = fleetrl_eval(config)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert (metrics["judged"], metrics["url"]) == (3.0, 1.0)
    for i in range(2):
        log = (tmp_path / "run" / "eval" / f"judge-{i}.log").read_text()
        assert f"--model {judge}" in log and "serve inference" in log
