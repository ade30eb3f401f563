#!/usr/bin/env python3
"""Train the OpenAI-SDK agent of agent.py as it is, with the rollout gateways in this process.

    python examples/openai_agent/train.py --model PATH [--steps 10] [--log-path runs/openai_agent] [--set KEY=VALUE]

The run's settings come from run.toml beside this file (rows: problems.jsonl); flags and `--set` override them. Every
other service starts as a local process (`fleetrl.main`); `fleetrl up examples/openai_agent/run.toml` runs the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollout import make_rollout_fn

from fleetrl import Config, main
from fleetrl.config import parse_override

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-model", "--model", dest="base_model", required=True, help="HF chat model: path or hub id")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (max_steps)")
    p.add_argument("--log-path", default="runs/openai_agent", help="metrics.jsonl, service logs, final model")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="inference engine (vllm on a GPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any Config field")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    overrides = {"base_model": args.base_model, "max_steps": args.steps, "log_path": args.log_path}
    overrides["dataset"] = str(HERE / "problems.jsonl")
    overrides.update(parse_override(item) for item in args.set)
    return Config.from_toml(HERE / "run.toml", overrides)


if __name__ == "__main__":
    args = parse_args()
    summary = main(build_config(args), rollout_fn_factory=make_rollout_fn, engine=args.engine)
    print(summary["last_metrics"])
    raise SystemExit(summary["exit_code"])
