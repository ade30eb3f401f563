"""Train any HF causal LM on pre-tokenized single-turn rows (token in, token out).

    python examples/single_turn_token_in/train.py --model PATH [--steps 20] [--log-path runs/single_turn]
    python examples/single_turn_token_in/train.py --model PATH --write-rows runs/single_turn_rows.jsonl  # run.toml

Rows are {"prompt_tokens": [...], "answer": "..."}: from --data (a JSONL you tokenized yourself), or built here by
tokenizing synthetic addition questions with the model's tokenizer (its chat template when it has one). Every
service runs as a local process (`fleetrl.main`, as `fleetrl up` does). Any Config field: --set KEY=VALUE.
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
    "completions_per_prompt": 8,
    "prompt_groups_per_step": 4,
    "max_completion_tokens": 16,
    "max_seq_len": 256,
    "learning_rate": 1e-5,
    "kl_beta": 0.0,
}


def encode_prompt(tokenizer: Any, question: str) -> list[int]:
    """The prompt as token ids: the chat template with the generation prompt if the model has one, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{question} Reply with just the number."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(f"Question: {question}\nAnswer:")


def make_rows(tokenizer: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` additions of two numbers below 100, pre-tokenized."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt_tokens": encode_prompt(tokenizer, f"What is {a} + {b}?"), "answer": str(a + b)})
    return rows


def read_rows(path: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("prompt_tokens"), list) or "answer" not in row:
            raise SystemExit(f"{path}:{i}: each row needs 'prompt_tokens' (a list of ints) and 'answer'")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF causal LM: a local path or hub id")
    add_run_args(p, log_path="runs/single_turn", steps=20)
    add_rows_args(
        p,
        data_help="JSONL of pre-tokenized rows; default: synthetic addition questions",
        num_rows=512,
        num_rows_help="synthetic rows to build when --data is not given",
        write_rows_help="write the tokenized rows to PATH and exit (for run.toml)",
    )
    add_up_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    return recipe_config(args, DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    if args.data:
        rows = read_rows(args.data)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_model or cfg.base_model)
        rows = make_rows(tokenizer, args.num_rows, cfg.seed)
    if args.write_rows:
        write_rows(args.write_rows, rows)
        return 0
    return fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, rows=rows, **up_options(args))["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
