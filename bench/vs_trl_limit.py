"""The limit arm of bench/vs_trl.py: what one step costs with no framework around it, one process.

    python bench/vs_trl_limit.py --init DIR --out DIR [--steps 100]

Per step: bare `generate` of P x G = 16 x 8 completions (5 new tokens, T = 1, one batched call per prompt length)
of the warm-started model, then one forward/backward of a GRPO-style token-mean loss on those 128 sequences and an
AdamW step (grad clip 1.0). Writes OUT/steps.json: the wall time of each phase of every step, and the step ends.
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

P, G, NEW = 16, 8, 5


def generate(model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """G sampled completions per prompt (full sequences, end of text then padded with it), batched by length."""
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).extend([p] * G)
    out: list[list[int]] = []
    for batch in by_len.values():
        ids = torch.tensor(batch)
        seq = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=NEW,
            pad_token_id=tokenizer.eos_token_id,
        )
        out.extend(seq.tolist())
    return out


def train_step(model, optim, seqs: list[list[int]], eos: int) -> None:
    """One fwd/bwd of a token-mean policy-gradient loss (random advantages: the cost, not the learning) + AdamW."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), eos, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    logits = model(input_ids=tokens[:, :-1]).logits
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    mask = torch.zeros_like(logprobs)
    mask[:, -NEW:] = 1
    adv = torch.randn(len(seqs), 1)
    loss = -(adv * torch.exp(logprobs - logprobs.detach()) * mask).sum() / mask.sum()
    optim.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    init, out = Path(args.init), Path(args.out)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(init / "model")
    model = AutoModelForCausalLM.from_pretrained(init / "model", dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    rows = [json.loads(line) for line in (init / "train.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    gen_s, train_s, ends = [], [], []
    for _ in range(args.steps):
        prompts = [tokenizer.encode(r["prompt"]) for r in rng.sample(rows, P)]
        t0 = time.perf_counter()
        model.eval()
        with torch.no_grad():
            seqs = generate(model, tokenizer, prompts)
        t1 = time.perf_counter()
        model.train()
        train_step(model, optim, seqs, tokenizer.eos_token_id)
        t2 = time.perf_counter()
        gen_s.append(t1 - t0)
        train_s.append(t2 - t1)
        ends.append(time.time())
    result = {"start": START, "steps": ends, "generate_s": gen_s, "train_s": train_s, "end": time.time()}
    (out / "steps.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
