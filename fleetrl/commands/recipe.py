"""The command line the recipe examples share (examples/*/train.py), in the spirit of the Tinker cookbook's cli_utils.

A recipe's train.py keeps its own flags, rows and config logic, and takes the common part from here:

    p = argparse.ArgumentParser(description="Train on my task.")
    p.add_argument("--model", required=True, help="HF causal LM: a local path or hub id")
    add_run_args(p, log_path="runs/my_task")       # --steps --log-path
    add_rows_args(p, data_help="JSONL of rows")    # --data --num-rows --write-rows
    add_up_args(p)                                 # --engine --inference-args --trainer-args --set --resume --overwrite
    args = p.parse_args()
    cfg = recipe_config(args, DEFAULTS)            # DEFAULTS < --model/--log-path/--steps < fields < --set
    fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=rows, **up_options(args))
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fleetrl.config import Config, parse_override


def add_run_args(parser: argparse.ArgumentParser, *, log_path: str, steps: int = 20) -> None:
    """--steps (max_steps) and --log-path, with this recipe's defaults."""
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps (max_steps)")
    parser.add_argument("--log-path", default=log_path, help="metrics.jsonl, service logs, final model")


def add_rows_args(
    parser: argparse.ArgumentParser,
    *,
    data_help: str,
    num_rows: int = 512,
    num_rows_help: str = "synthetic rows when --data is not given",
    write_rows_help: str = "write the rows to PATH and exit",
) -> None:
    """--data (a JSONL of rows; optional), --num-rows (synthetic rows otherwise) and --write-rows PATH."""
    parser.add_argument("--data", help=data_help)
    parser.add_argument("--num-rows", type=int, default=num_rows, help=num_rows_help)
    parser.add_argument("--write-rows", metavar="PATH", help=write_rows_help)


def add_up_args(parser: argparse.ArgumentParser) -> None:
    """--engine, --inference-args, --trainer-args (how `fleetrl.main` starts the services), --set KEY=VALUE, and
    --resume / --overwrite (what to do with a run already in --log-path)."""
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="inference engine (vllm on a GPU)")
    parser.add_argument("--inference-args", default="", help="extra flags for each inference replica, one string")
    parser.add_argument("--trainer-args", default="", help="extra flags for the trainer, e.g. '--device cuda'")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any Config field")
    log_path = parser.add_mutually_exclusive_group()
    log_path.add_argument("--resume", action="store_true", help="continue the run in --log-path (stopped or crashed)")
    log_path.add_argument("--overwrite", action="store_true", help="delete the run in --log-path and start over")


def recipe_config(args: argparse.Namespace, defaults: Mapping[str, Any], **fields: Any) -> Config:
    """The run's `Config`: the recipe's `defaults`, then base_model/log_path/max_steps from --model/--log-path/--steps,
    then `fields`, then each --set KEY=VALUE, so --set always wins. Raises `ConfigError` for a --set without '=' or
    for an invalid config (the message names the field)."""
    data = {**defaults, "base_model": args.model, "log_path": args.log_path, "max_steps": args.steps, **fields}
    overrides = dict(parse_override(s) for s in args.set)
    data.update(overrides)
    return Config.load(data, source="train.py", override_keys=overrides)


def write_rows(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write `rows` as JSONL to `path` (creating its folder) and say so on stdout."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row) + "\n" for row in rows]
    out.write_text("".join(lines))
    print(f"wrote {len(lines)} rows to {out}")


def up_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments for `fleetrl.main` that say how to start the services: the engine, the
    --inference-args / --trainer-args strings split as a shell would, and resume / overwrite."""
    return {
        "engine": args.engine,
        "inference_args": shlex.split(args.inference_args),
        "trainer_args": shlex.split(args.trainer_args),
        "resume": args.resume,
        "overwrite": args.overwrite,
    }
