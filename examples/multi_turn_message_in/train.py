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
import shlex
from pathlib import Path
from typing import Any

import fleetrl
from fleetrl import Config
from fleetrl.config import parse_override

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
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (max_steps)")
    p.add_argument("--log-path", default="runs/multi_turn", help="metrics.jsonl, service logs, final model")
    p.add_argument("--max-turns", type=int, default=3, help="model turns per rollout (1 = no retry)")
    p.add_argument("--retry-discount", type=float, default=0.5, help="reward factor per retry")
    p.add_argument("--data", help="JSONL of message rows; default: synthetic arithmetic")
    p.add_argument("--num-rows", type=int, default=512, help="synthetic rows when --data is not given")
    p.add_argument("--write-rows", metavar="PATH", help="write the rows to PATH and exit")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="inference engine (vllm on a GPU)")
    p.add_argument("--inference-args", default="", help="extra flags for each inference replica, one string")
    p.add_argument("--trainer-args", default="", help="extra flags for the trainer, e.g. '--device cuda'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any Config field")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    fields = {**DEFAULTS, "base_model": args.model, "log_path": args.log_path, "max_steps": args.steps}
    fields.update(parse_override(s) for s in args.set)
    cfg = Config.load(fields, source="train.py")
    extras = {"max_turns": args.max_turns, "retry_discount": args.retry_discount, "max_seq_len": cfg.max_seq_len}
    cfg.rollout_extras = {**extras, **cfg.rollout_extras}
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    rows = read_rows(args.data) if args.data else make_rows(args.num_rows, cfg.seed)
    if args.write_rows:
        out = Path(args.write_rows)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} rows to {out}")
        return 0
    up = {
        "engine": args.engine,
        "inference_args": shlex.split(args.inference_args),
        "trainer_args": shlex.split(args.trainer_args),
    }
    return fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=rows, **up)


if __name__ == "__main__":
    raise SystemExit(main())
