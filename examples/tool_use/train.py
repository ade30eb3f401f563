"""Train any HF causal LM as a calculator-using agent; the tool is slow, so try --sync against async.

    python examples/tool_use/train.py --model PATH [--steps 20] [--log-path runs/tool_use] [--tool-latency 0.5]
    python examples/tool_use/train.py --model PATH --sync            # strictly on-policy: generation waits
    python examples/tool_use/train.py --model PATH --offpolicy 2     # async: rollouts overlap training

Rows are {"question": ..., "answer": ...}: from --data, or synthetic multiplications built here (`--write-rows
PATH` writes them and exits). Prints samples/s at the end (from metrics.jsonl). Every service runs as a local
process (`fleetrl.main`, as `fleetrl up` does). Any Config field: --set KEY=VALUE.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import fleetrl
from fleetrl import Config
from fleetrl.commands.recipe import add_rows_args, add_run_args, add_up_args, recipe_config, up_options, write_rows

HERE = Path(__file__).resolve().parent
# A file path, so the gateway processes load the factory whatever their working directory and sys.path.
ROLLOUT = f"{HERE / 'rollout.py'}:make_rollout_fn"
DEFAULTS: dict[str, Any] = {
    "completions_per_prompt": 4,
    "prompt_groups_per_step": 4,
    "max_completion_tokens": 16,
    "max_seq_len": 256,
    "learning_rate": 1e-5,
    "kl_beta": 0.0,
}


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` questions `a * b + c` with 2-3 digit numbers: hard to do in one's head, easy with a calculator."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(12, 999), rng.randint(12, 99), rng.randint(1, 999)
        rows.append({"question": f"What is {a} * {b} + {c}?", "answer": str(a * b + c)})
    return rows


def read_rows(path: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("question"), str) or "answer" not in row:
            raise SystemExit(f"{path}:{i}: each row needs 'question' and 'answer'")
    return rows


def samples_per_s(log_path: str | Path) -> dict[str, float]:
    """Throughput of a finished run from its metrics.jsonl: samples trained per second of wall time from the end of
    the first step (start-up excluded) to the end of the last, and the mean fraction of each step the trainer spent
    waiting for rollouts. (Averaging the per-step `perf/samples_per_s` instead would overweight the short steps
    whose groups were ready in advance.)"""
    lines = (Path(log_path) / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, filter(str.strip, lines)) if "data/samples" in m]  # not eval/ lines
    out = {"steps": float(len(steps))}
    if len(steps) >= 2:
        span = steps[-1]["time"] - steps[0]["time"]
        out["samples_per_s"] = sum(m["data/samples"] for m in steps[1:]) / span if span > 0 else 0.0
        out["mean_wait_time_ratio"] = sum(m["perf/wait_time_ratio"] for m in steps[1:]) / (len(steps) - 1)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF causal LM: a local path or hub id")
    add_run_args(p, log_path="runs/tool_use", steps=20)
    p.add_argument("--tool-latency", type=float, default=0.5, help="seconds each calculator call takes")
    p.add_argument("--tool-calls", type=int, default=1, help="calculator turns before the answer")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sync", action="store_true", help="synchronous_training: generate only on the newest policy")
    mode.add_argument("--offpolicy", type=int, default=1, help="O = max_head_offpolicy_versions (async when >= 1)")
    add_rows_args(p, data_help="JSONL of question/answer rows; default: synthetic", num_rows=1024)
    add_up_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    mode = {"synchronous_training": True} if args.sync else {"max_head_offpolicy_versions": args.offpolicy}
    extras = {"tool_latency_s": args.tool_latency, "tool_calls": args.tool_calls}
    return recipe_config(args, DEFAULTS, **mode, rollout_extras=extras)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    rows = read_rows(args.data) if args.data else make_rows(args.num_rows, cfg.seed)
    if args.write_rows:
        write_rows(args.write_rows, rows)
        return 0
    code = fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=rows, **up_options(args))["exit_code"]
    if code == 0:
        mode = "sync" if cfg.synchronous_training else f"async O={cfg.max_head_offpolicy_versions}"
        print(f"tool_use ({mode}): {json.dumps(samples_per_s(cfg.log_path))}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
