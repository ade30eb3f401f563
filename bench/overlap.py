"""Training while the weights travel: the trainer's idle time with serial vs overlapped pushes (issue 39 item 1).

    python bench/overlap.py [--steps 12] [--repeats 2] [--cache /tmp/fleetrl-overlap]

A run where loading a version is slow next to training it: a 113M-parameter Qwen2-shaped model (0.45 GB in float32,
random weights, 512-token vocabulary) trained on the arithmetic rows with a small step (P = 2 prompts x G = 4, 5 new
tokens), one hf replica, O = 1, through `fleetrl up`. Two arms, interleaved, `--repeats` each: `serial`
(`overlap_weight_push = false`: every push awaited before the next TrainStep, as before) and `overlapped` (the
default). Per run, medians over steps 2..N of the controller's step line: s/step (interval between step ends),
perf/push_wait_time (the trainer idle waiting for a push), perf/train_wait_time (idle waiting for rollouts),
perf/version_serve_time (publish to served by the replica), and the idle share (both waits over the step period).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {"serial": False, "overlapped": True}


def prepare(cache: Path) -> tuple[Path, Path]:
    """The model (bench/replica_serves.py's 113M shape, 0.45 GB in float32, built once) and the arithmetic rows (no
    warm start)."""
    sys.path.insert(0, str(REPO / "bench"))
    from replica_serves import build_model

    model = build_model(cache, "113M")
    rows = cache / "train.jsonl"
    if not rows.exists():
        lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a in range(50) for b in range(0, 50, 7)]
        rows.write_text("\n".join(lines) + "\n")
    return model, rows


def run_arm(arm: str, model: Path, rows: Path, out: Path, steps: int) -> dict[str, float]:
    run = {
        "base_model": str(model),
        "dataset": str(rows),
        "log_path": str(out / "run"),
        "seed": 0,
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_steps": steps,
        "max_completion_tokens": 5,
        "max_seq_len": 16,
        "learning_rate": 1e-5,
        "max_head_offpolicy_versions": 1,
        "overlap_weight_push": ARMS[arm],
    }
    up = {"rollout": f"{REPO / 'examples' / 'arithmetic' / 'rollout.py'}:make_rollout_fn", "engine": "hf"}
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({"run": run, "up": {**up, "replicas": 1, "gateways": 1}}))
    with open(out / "stdout.log", "w") as log:
        cmd = [sys.executable, "-m", "fleetrl", "up", str(config), "--overwrite"]
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{arm}: fleetrl up failed (exit {rc}):\n{(out / 'stdout.log').read_text()[-3000:]}")
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in lines if "perf/step_time" in r]
    ends = [r["time"] for r in steps_rows]
    later = steps_rows[1:]

    def med(key: str) -> float:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else float("nan")

    period = statistics.median(b - a for a, b in itertools.pairwise(ends))
    return {
        "s_per_step": period,
        "push_wait_s": med("perf/push_wait_time"),
        "rollout_wait_s": med("perf/train_wait_time"),
        "train_s": med("perf/train_time"),
        "version_serve_s": med("perf/version_serve_time"),
        "idle_share": (med("perf/push_wait_time") + med("perf/train_wait_time")) / period,
        "superseded": float(steps_rows[-1].get("async/versions_superseded", 0)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fleetrl-overlap"))
    args = parser.parse_args(argv)
    model, rows = prepare(args.cache)
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    started = time.monotonic()
    for rep in range(args.repeats):
        for arm in ARMS if rep % 2 == 0 else list(ARMS)[::-1]:
            result = run_arm(arm, model, rows, args.cache / f"{arm}-{rep}", args.steps)
            results[arm].append(result)
            print(f"overlap: repeat {rep} {arm}: {result}", file=sys.stderr, flush=True)
    keys = ["s_per_step", "train_s", "push_wait_s", "rollout_wait_s", "version_serve_s", "idle_share", "superseded"]
    print(f"# {args.repeats} repeats x {args.steps} steps, {time.monotonic() - started:.0f} s")
    print("| arm | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for arm, runs in results.items():
        cells = []
        for key in keys:
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
        print(f"| {arm} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
