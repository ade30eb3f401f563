"""Async vs sync on a rollout-bound workload: each rollout awaits a simulated 0.2 s tool call.

    python bench/async_vs_sync.py [--steps 8] [--latency 0.2]

Runs the real stack (`fleetrl up`, hf engine, tiny model) twice: `synchronous_training = true` and
`max_head_offpolicy_versions = 2`, and reports steps/s of each (from metrics.jsonl, first step excluded) and the
ratio. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_mode(model: str, work: Path, name: str, run_extra: dict, steps: int, latency: float) -> dict:
    rows = work / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}: what is {i} + {i}?"}) + "\n" for i in range(400)))
    run = {
        "base_model": model,
        "dataset": str(rows),
        "log_path": str(work / name),
        "kl_beta": 0.0,
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 4,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "max_steps": steps,
        "learning_rate": 1e-4,
        "rollout_extras": {"tool_latency_s": latency},
        **run_extra,
    }
    up = {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn", "engine": "hf"}
    config = work / f"{name}.json"
    config.write_text(json.dumps({"run": run, "up": up}))
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(config)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    span = metrics[-1]["time"] - metrics[0]["time"]
    wait_ratio = sum(m["perf/wait_time_ratio"] for m in metrics[1:]) / (len(metrics) - 1)
    return {
        "steps_per_s": (len(metrics) - 1) / span,
        "samples_per_s": (len(metrics) - 1) * 16 / span,
        "mean_wait_time_ratio": wait_ratio,
        "max_version_offset": max(m["async/version_offset_max"] for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()
    from fleetrl.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="fleetrl-bench-async-"))
    model = str(build_tiny_model(work / "model"))
    sync = run_mode(model, work, "sync", {"synchronous_training": True}, args.steps, args.latency)
    asyn = run_mode(model, work, "async", {"max_head_offpolicy_versions": 2}, args.steps, args.latency)
    print(json.dumps({"sync": sync, "async_o2": asyn, "speedup": asyn["steps_per_s"] / sync["steps_per_s"]}, indent=2))


if __name__ == "__main__":
    main()
