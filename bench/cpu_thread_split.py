"""`fleetrl up`'s CPU thread split on the main job: every process on every core vs a share each.

    python examples/arithmetic/warm_start.py      # once: runs/arithmetic/init
    python bench/cpu_thread_split.py [--modes async,sync]

Runs `fleetrl up examples/arithmetic/run.toml` (async O = 1, and strictly on-policy) twice each: with
OMP_NUM_THREADS set to the machine's core count (fleetrl up then leaves every process on every core, torch's
default) and unset (fleetrl up shares the cores: fleetrl/up/cpu_threads.py). Reports wall seconds, the seconds
from the first step to the last, the mean trainer forward/backward time and wait ratio, and the final held-out
accuracy. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "async": [],
    "sync": ["--set", "synchronous_training=true", "--set", "max_head_offpolicy_versions=0"],
}


def run_once(mode: str, split: bool) -> dict:
    log_path = REPO / "runs" / f"bench_threads_{mode}_{'split' if split else 'all'}"
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if not split:
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    argv = [sys.executable, "-m", "fleetrl", "up", "examples/arithmetic/run.toml", "--set", f"log_path={log_path}"]
    argv.append("--overwrite")  # a re-run of the benchmark replaces its earlier run
    started = time.monotonic()
    subprocess.run([*argv, *MODES[mode]], cwd=REPO, env=env, check=True, capture_output=True, timeout=1800)
    wall = time.monotonic() - started
    lines = [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "rollout/raw_reward" in m]
    final = [m for m in lines if "eval/accuracy" in m][-1]
    return {
        "mode": mode,
        "threads": "shared" if split else "every process on every core",
        "wall_s": round(wall, 1),
        "steps_span_s": round(steps[-1]["time"] - steps[0]["time"], 1),
        "fwd_bwd_s": round(sum(m["perf/fwd_bwd_time"] for m in steps) / len(steps), 3),
        "wait_ratio": round(sum(m["perf/wait_time_ratio"] for m in steps) / len(steps), 3),
        "final_greedy": final["eval/accuracy"],
        "final_sampled": final["eval/sampled_accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="async,sync")
    args = parser.parse_args()
    if not (REPO / "runs" / "arithmetic" / "init" / "model").exists():
        sys.exit("run python examples/arithmetic/warm_start.py first")
    for mode in args.modes.split(","):
        for split in (False, True):
            print(json.dumps(run_once(mode, split)), flush=True)


if __name__ == "__main__":
    main()
