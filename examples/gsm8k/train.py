"""GRPO on GSM8K-format math problems with any HF causal LM.

    python examples/gsm8k/train.py --model PATH --data gsm8k_train.jsonl [--steps 100] [--log-path runs/gsm8k]
    python examples/gsm8k/train.py --model Qwen/Qwen3-0.6B --data gsm8k_train.jsonl --engine vllm \
        --inference-args "--dtype bfloat16 --kv-cache-gib 8 --max-model-len 2048" --trainer-args "--device cuda" \
        --set dtype=bfloat16 --set max_completion_tokens=1024 --set max_seq_len=1536      # on a GPU machine

--data is a JSONL of {"question": ..., "answer": "... #### 42"} rows (GSM8K's own format; examples/gsm8k/sample.jsonl
has a few hand-written ones). Every service runs as a local process (`fleetrl.main`, as `fleetrl up` does).
Any Config field: --set KEY=VALUE.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import fleetrl
from fleetrl import Config
from fleetrl.commands.recipe import add_run_args, add_up_args, recipe_config, up_options

HERE = Path(__file__).resolve().parent
# A file path, so the gateway processes load the factory whatever their working directory and sys.path.
ROLLOUT = f"{HERE / 'rollout.py'}:make_rollout_fn"
DEFAULTS: dict[str, Any] = {
    "completions_per_prompt": 8,
    "prompt_groups_per_step": 8,
    "max_completion_tokens": 512,
    "max_seq_len": 1024,
    "learning_rate": 1e-6,
    "kl_beta": 0.0,
}


def check_rows(path: Path) -> int:
    """Fail before any service starts if a row is not GSM8K-shaped; returns the row count."""
    if not path.is_file():
        raise SystemExit(f"--data {path}: no such file")
    count = 0
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise SystemExit(f"{path}:{lineno}: each row needs a 'question' string")
        if "####" not in str(row.get("answer", "")):
            raise SystemExit(f"{path}:{lineno}: 'answer' must end with '#### <number>' (the GSM8K format)")
        count += 1
    if not count:
        raise SystemExit(f"{path}: no rows")
    return count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF causal LM: a local path or hub id")
    p.add_argument("--data", required=True, type=Path, help="GSM8K-format JSONL (question, answer with '####')")
    add_run_args(p, log_path="runs/gsm8k", steps=100)
    add_up_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    return recipe_config(args, DEFAULTS, dataset=str(args.data.resolve()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_rows(args.data)
    cfg = build_config(args)
    return fleetrl.main(cfg, rollout_fn_factory=ROLLOUT, **up_options(args))["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
