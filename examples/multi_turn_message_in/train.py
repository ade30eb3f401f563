"""Train any HF chat model on a multi-turn retry task: answer, get feedback when wrong, try again.

    python examples/multi_turn_message_in/train.py --model PATH [--steps 20] [--log-path runs/multi_turn]
        [--max-turns 3] [--data rows.jsonl] [--set KEY=VALUE ...]

Rows are OpenAI-style messages plus the answer: {"messages": [{"role": "system", ...}, {"role": "user", ...}],
"answer": "42"}; from --data, or synthetic arithmetic built here (`--write-rows PATH` writes them and exits).
The model needs a chat template. Every service runs as a local process (`fleetrl.main`, as `fleetrl up` does).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import fleetrl
from fleetrl import Config
from fleetrl.recipe_cli import add_rows_args, add_run_args, add_up_args, recipe_config, up_options, write_rows

HERE = Path(__file__).resolve().parent
# A file path, so the gateway processes load the factory whatever their working directory and sys.path.
ROLLOUT = f"{HERE / 'rollout.py'}:make_rollout_fn"
SYSTEM_PROMPT = "You are a careful calculator. Think briefly, then end your reply with the answer as a number."
DEFAULTS: dict[str, Any] = {
    "completions_per_prompt": 8,
    "prompt_groups_per_step": 4,
    "max_completion_tokens": 64,
    "max_seq_len": 512,
    "learning_rate": 1e-5,
    "kl_beta": 0.0,
}


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


def read_rows(path: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("messages"), list) or "answer" not in row:
            raise SystemExit(f"{path}:{i}: each row needs 'messages' (a list of chat messages) and 'answer'")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF chat model: a local path or hub id")
    add_run_args(p, log_path="runs/multi_turn", steps=20)
    p.add_argument("--max-turns", type=int, default=3, help="model turns per rollout (1 = no retry)")
    p.add_argument("--retry-discount", type=float, default=0.5, help="reward factor per retry")
    add_rows_args(p, data_help="JSONL of message rows; default: synthetic arithmetic", num_rows=512)
    add_up_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    cfg = recipe_config(args, DEFAULTS)
    extras = {"max_turns": args.max_turns, "retry_discount": args.retry_discount, "max_seq_len": cfg.max_seq_len}
    cfg.rollout_extras = {**extras, **cfg.rollout_extras}
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    rows = read_rows(args.data) if args.data else make_rows(args.num_rows, cfg.seed)
    if args.write_rows:
        write_rows(args.write_rows, rows)
        return 0
    return fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=rows, **up_options(args))["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
