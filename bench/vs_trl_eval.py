"""The held-out evaluator of bench/vs_trl.py: one model folder in, greedy and sampled accuracy out (same for every arm).

    python bench/vs_trl_eval.py MODEL_DIR EVAL_JSONL [--temperature 1.0] [--max-new 5] [--seed 0]

Each of the example's held-out problems is answered once greedily and once sampled at the training temperature, up
to `--max-new` tokens; the reward is the example's own `score` (exact digits, then end of text). Prompts are batched
by token length (no padding), seeded, single process. Prints one JSON line {"greedy": ..., "sampled": ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic"))
from arithmetic_task import score


@torch.no_grad()
def answers(model, tokenizer, rows: list[dict], temperature: float, max_new: int, seed: int) -> list[float]:
    """Each row's reward for one completion: greedy when `temperature` is 0, else sampled (seeded)."""
    eos = tokenizer.eos_token_id
    by_len: dict[int, list[int]] = defaultdict(list)
    prompts = [tokenizer.encode(r["prompt"]) for r in rows]
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    gen = torch.Generator().manual_seed(seed)
    rewards = [0.0] * len(rows)
    for n, idx in sorted(by_len.items()):
        ids = torch.tensor([prompts[i] for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        for row_i, seq in zip(idx, ids[:, n:].tolist(), strict=True):
            finished = eos in seq
            text = tokenizer.decode(seq[: seq.index(eos)] if finished else seq)
            rewards[row_i] = score(text, rows[row_i]["answer"], finished)
    return rewards


def evaluate(model_dir: str, eval_jsonl: str, temperature: float = 1.0, max_new: int = 5, seed: int = 0) -> dict:
    """Greedy and sampled held-out accuracy of the model in `model_dir`."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in Path(eval_jsonl).read_text().splitlines() if line.strip()]
    greedy = answers(model, tokenizer, rows, 0.0, max_new, seed)
    sampled = answers(model, tokenizer, rows, temperature, max_new, seed)
    return {"greedy": sum(greedy) / len(rows), "sampled": sum(sampled) / len(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("eval_jsonl")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(evaluate(args.model_dir, args.eval_jsonl, args.temperature, args.max_new, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
