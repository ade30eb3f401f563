#!/usr/bin/env python3
"""Train any HF chat model on a multi-turn retry task: answer, get feedback when wrong, try again.

    python examples/multi_turn_message_in/train.py --base-model PATH [--steps 20] [--log-path runs/multi_turn]
        [--max-turns 3] [--data rows.jsonl] [--wandb-project P] [--replica-count N] [--set KEY=VALUE ...]

Written in the cookbook's structure (`training/examples/rl/multi_turn_message_in/train.py`): a `Config` with the
cookbook's fields and its `TrainerConfig` / `DeployConfig` / `WandBConfig` objects, then `main(cfg,
rollout_fn_factory=make_rollout_fn, rows=..., rollout_extras=..., dynamic_filter_fn=...)`. Rows are OpenAI-style
messages plus the answer: {"messages": [{"role": "system", ...}, {"role": "user", ...}], "answer": "42"}; from
--data, or synthetic arithmetic built here (`--write-rows PATH` writes them and exits). The model needs a chat
template. The rollout gateways run in this process, every other service as a local process (`fleetrl.main`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
from pathlib import Path
from typing import Any

from rollout import make_rollout_fn

from fleetrl import Config, DeployConfig, TrainerConfig, WandBConfig, main
from fleetrl.commands.recipe import write_rows
from fleetrl.config import parse_override

SYSTEM_PROMPT = "You are a careful calculator. Think briefly, then end your reply with the answer as a number."


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` questions `a + b - c` or `a * b + c` with small numbers, as chat messages."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(1, 50)
        question, answer = (f"{a} + {b} - {c}", a + b - c) if rng.random() < 0.5 else (f"{a} * {b} + {c}", a * b + c)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {question}?"},
        ]
        rows.append({"messages": messages, "answer": str(answer)})
    return rows


def read_rows(path: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:max_rows]
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("messages"), list) or "answer" not in row:
            raise SystemExit(f"{path}:{i}: each row needs 'messages' (a list of chat messages) and 'answer'")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-model", "--model", dest="base_model", required=True, help="HF chat model: path or hub id")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer; default: the base model's")
    p.add_argument("--data", help="JSONL of message rows; default: synthetic arithmetic")
    p.add_argument("--num-rows", type=int, default=512, help="synthetic rows when --data is not given")
    p.add_argument("--write-rows", metavar="PATH", help="write the rows to PATH and exit")
    p.add_argument("--output-dir", default=None, help="where the final model goes; default: <log-path>/final")
    p.add_argument("--max-rows", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (max_steps)")
    p.add_argument("--completions-per-prompt", type=int, default=8)
    p.add_argument("--max-completion-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=512, help="the rollout stops before a turn would not fit")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompt-groups-per-step", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--kl-beta", type=float, default=0.0)
    p.add_argument("--max-head-offpolicy-versions", type=int, default=0, help="0 = strict on-policy")
    p.add_argument("--ppo-n-minibatches", type=int, default=1)
    p.add_argument("--filter-constant-reward", action="store_true", help="drop groups whose rewards are all equal")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per rollout (1 = no retry)")
    p.add_argument("--retry-discount", type=float, default=0.5, help="reward factor per retry")
    p.add_argument("--log-path", default="runs/multi_turn", help="metrics.jsonl, service logs, final model")
    p.add_argument("--wandb-entity", default=os.environ.get("WANDB_ENTITY", ""))
    p.add_argument("--wandb-project", default=None, help="log to W&B in this project; default: no W&B")
    p.add_argument("--wandb-run-name", default=None)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0 = full-parameter training)")
    p.add_argument("--synchronous-training", action="store_true", help="no rollout/train overlap")
    p.add_argument("--max-concurrency-rollout-sample", type=int, default=None, help="samples in flight at once")
    p.add_argument("--replica-count", type=int, default=None, help="inference replicas (default 1)")
    # fleetrl's own: how the local services start, and any Config field.
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="inference engine (vllm on a GPU)")
    p.add_argument("--inference-args", default="", help="extra flags for each inference replica, one string")
    p.add_argument("--trainer-args", default="", help="extra flags for the trainer, e.g. '--device cuda'")
    p.add_argument("--resume", action="store_true", help="continue the run in --log-path (stopped or crashed)")
    p.add_argument("--overwrite", action="store_true", help="delete the run in --log-path and start over")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any Config field")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    """The cookbook's `Config(...)` keyword arguments, then each --set KEY=VALUE (fleetrl's: any Config field);
    `ConfigError` naming the field for a bad one."""
    fields = dict(
        log_path=args.log_path,
        base_model=args.base_model,
        learning_rate=args.learning_rate,
        kl_beta=args.kl_beta,
        completions_per_prompt=args.completions_per_prompt,
        max_completion_tokens=args.max_completion_tokens,
        max_seq_len=args.max_seq_len,
        temperature=args.temperature,
        epochs=args.epochs,
        max_rows=args.max_rows,
        max_steps=args.steps,
        lora_rank=args.lora_rank,
        prompt_groups_per_step=args.prompt_groups_per_step,
        max_head_offpolicy_versions=args.max_head_offpolicy_versions,
        ppo_n_minibatches=args.ppo_n_minibatches,
        max_concurrency_rollout_sample=args.max_concurrency_rollout_sample,
        synchronous_training=args.synchronous_training,
        output_dir=args.output_dir,
        trainer=TrainerConfig(),  # fleetrl sizes the trainer with trainer_procs / trainer_gpus, not a shape id
        deployment=DeployConfig(tokenizer_model=args.tokenizer_model, replica_count=args.replica_count),
        wandb=WandBConfig(entity=args.wandb_entity, project=args.wandb_project, run_name=args.wandb_run_name),
    )
    overrides = dict(parse_override(s) for s in args.set)
    return Config.load({**fields, **overrides}, source="train.py", override_keys=overrides)


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    rows = read_rows(args.data, args.max_rows) if args.data else make_rows(args.num_rows, seed=0)
    if args.write_rows:
        write_rows(args.write_rows, rows)
        return 0
    # Drop prompt groups whose rewards are all equal: their GRPO advantages are 0, a step on them does nothing.
    dynamic_filter_fn = (lambda pg: len(set(pg.rewards)) > 1) if args.filter_constant_reward else None
    summary = main(
        cfg,
        rollout_fn_factory=make_rollout_fn,
        rows=rows,
        rollout_extras={
            "max_turns": args.max_turns,
            "retry_discount": args.retry_discount,
            "max_seq_len": cfg.max_seq_len,
            **cfg.rollout_extras,
        },
        dynamic_filter_fn=dynamic_filter_fn,
        engine=args.engine,
        inference_args=shlex.split(args.inference_args),
        trainer_args=shlex.split(args.trainer_args),
        resume=args.resume,
        overwrite=args.overwrite,
    )
    return summary["exit_code"]


if __name__ == "__main__":
    raise SystemExit(run())
