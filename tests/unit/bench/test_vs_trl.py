"""bench/vs_trl.py: its fleetrl arms are the arithmetic example's run, and its table's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
import tomllib
from pathlib import Path

import pytest

from fleetrl.up.config import load_run_and_up

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


vs_trl = _load("vs_trl")
EXAMPLE = tomllib.loads((REPO / "examples" / "arithmetic" / "run.toml").read_text())["run"]
SHARED = ["completions_per_prompt", "prompt_groups_per_step", "max_completion_tokens", "temperature", "kl_beta"]
SHARED += ["learning_rate", "lr_warmup_steps", "grad_clip_norm", "policy_loss", "max_seq_len", "seed"]


@pytest.mark.parametrize("workload", sorted(vs_trl.WORKLOADS))
def test_fleetrl_arms_are_the_example_run_with_their_mode(tmp_path, workload):
    spec = vs_trl.WORKLOADS[workload]
    arms = [a for a in spec["arms"] if a.startswith("fleetrl")]
    assert arms
    for arm in arms:
        data = vs_trl.fleetrl_config(tmp_path, tmp_path / arm, arm, 100, spec["tool_latency"])
        path = tmp_path / f"{arm}.json"
        path.write_text(json.dumps(data))
        run, up, _ = load_run_and_up(path, [])
        assert {k: getattr(run, k) for k in SHARED} == {k: EXAMPLE[k] for k in SHARED}
        assert run.max_steps == 100
        assert run.eval_dataset is None  # every arm is evaluated afterwards by the same evaluator
        for key, value in vs_trl.FLEETRL_ARMS[arm].items():
            assert getattr(run, key) == value
        assert ("vs_trl_rollout.py" in up.rollout) == (spec["tool_latency"] > 0)
        assert run.rollout_extras.get("tool_latency_s", 0.0) == spec["tool_latency"]


def test_timing_excludes_the_first_step_and_measures_start_and_exit():
    result = vs_trl.timing(100.0, 131.0, [110.0, 110.5, 111.0, 112.0])
    assert result == {
        "s_per_step": pytest.approx(2.0 / 3),
        "start_to_first_step_s": 10.0,
        "last_step_to_exit_s": 19.0,
        "steps": 4,
        "step_s_median": 0.5,
        "step_s_p10": pytest.approx(0.5),
        "launched": 100.0,
        "exited": 131.0,
    }


def test_table_rates_each_arm_against_trl_and_lists_fleetrl_perf():
    run = {
        "step_s_median": 0.1,
        "step_s_p10": 0.05,
        "start_to_first_step_s": 5.0,
        "last_step_to_exit_s": 1.0,
        "greedy": 0.7,
        "sampled": 0.6,
    }
    results = {
        "trl": [{**run, "s_per_step": s} for s in (0.1, 0.2, 0.15)],
        "fleetrl_o1": [{**run, "s_per_step": s, "perf": {"perf/train_time": s / 2}} for s in (0.3, 0.4, 0.2)],
    }
    text = vs_trl.table(results)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert (
        "0.150 [0.100, 0.200] | 0.100 [0.100, 0.100] | 0.050 [0.050, 0.050] | 853 | 1.00x; 1.00x"
        in rows[vs_trl.LABELS["trl"]]
    )
    assert (
        "0.300 [0.200, 0.400] | 0.100 [0.100, 0.100] | 0.050 [0.050, 0.050] | 427 | 0.50x; 1.00x"
        in rows[vs_trl.LABELS["fleetrl_o1"]]
    )
    assert rows[vs_trl.LABELS["fleetrl_o1"]].endswith("| 0.700 / 0.600 |")
    assert rows["perf/train_time"] == "| perf/train_time | 0.15 |"
