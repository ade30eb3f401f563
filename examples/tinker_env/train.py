"""Train any HF causal LM on a Tinker environment (env.py) through fleetrl: one row per EnvGroupBuilder.

    python examples/tinker_env/train.py --model PATH [--steps 20] [--log-path runs/tinker_env]
        [--num-batches 16] [--groups-per-batch 4] [--set KEY=VALUE ...]

The rows are the RLDataset's builders ({"tinker_batch": i, "tinker_index": j}, `fleetrl.tinker.dataset_rows`); each
gateway rebuilds the same seeded dataset from rollout_extras. Every service runs as a local process (`fleetrl.main`,
as `fleetrl up` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import fleetrl
from fleetrl import Config
from fleetrl.commands.recipe import add_run_args, add_up_args, recipe_config, up_options
from fleetrl.tinker import dataset_rows

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # env.py, as the gateways load it next to rollout.py
from env import AdditionDataset  # noqa: E402

# A file path, so the gateway processes load the factory whatever their working directory and sys.path.
ROLLOUT = f"{HERE / 'rollout.py'}:make_rollout_fn"
DEFAULTS: dict[str, Any] = {
    "completions_per_prompt": 4,  # G: the envs each AdditionGroupBuilder makes
    "prompt_groups_per_step": 4,
    "max_completion_tokens": 16,
    "max_seq_len": 256,
    "learning_rate": 1e-5,
    "kl_beta": 0.0,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF causal LM: a local path or hub id")
    add_run_args(p, log_path="runs/tinker_env", steps=20)
    p.add_argument("--num-batches", type=int, default=16, help="RLDataset batches")
    p.add_argument("--groups-per-batch", type=int, default=4, help="EnvGroupBuilders per batch")
    add_up_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    extras = {"num_batches": args.num_batches, "groups_per_batch": args.groups_per_batch, "seed": 0}
    return recipe_config(args, DEFAULTS, rollout_extras=extras)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    extras = cfg.rollout_extras
    dataset = AdditionDataset(
        None, extras["num_batches"], extras["groups_per_batch"], cfg.completions_per_prompt, extras["seed"]
    )
    summary = fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=dataset_rows(dataset), **up_options(args))
    return summary["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
