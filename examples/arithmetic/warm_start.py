"""Build the arithmetic task's starting policy: a tiny Qwen2 model, briefly fine-tuned on addition (deterministic).

    python examples/arithmetic/warm_start.py [--out runs/arithmetic/init] [--steps 2000] [--noise 0.7]

Writes an HF model folder (weights + tokenizer), the task's rows (train.jsonl, eval.jsonl) and the supervised rows
(sft.jsonl: prompt/completion pairs, the --steps x --batch draws in training order), then trains with `fleetrl sft
examples/arithmetic/sft.toml` (run in this process, its paths set to --out) and prints the held-out greedy accuracy.
`--loop script` trains with this file's own loop instead (the warm start before `fleetrl sft`, kept to compare the
two: docs/benchmarks.md). The supervised data is mislabelled like a sloppy annotator's: 70 % of its targets are off
by one (the sum plus 1). The policy learns to add but mostly answers one too many, so it starts with a low reward,
and only the verifiable reward of the RL run in run.toml can correct it. Same arguments -> the same model on the
same machine (seeded, CPU, single thread); not across machines: the float kernels torch, oneMKL and oneDNN pick
depend on the CPU's instruction set (AVX2, AVX-512, AMX), their rounding differs in the last bits, and 2,000 steps
carry those bits into visibly different models (held-out greedy accuracy 0.245, 0.300 and 0.140 on three days'
machines; README).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from rich.progress import Progress, TextColumn, track
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arithmetic_task import split_rows

from fleetrl.tiny_model import build_tiny_model


def noisy_answer(row: dict, rng: random.Random, noise: float) -> str:
    """The sum, or with probability `noise` the sum plus one: a systematic labelling error that supervised
    training copies faithfully and that the exact-answer reward of the RL run penalises."""
    return row["answer"] if rng.random() >= noise else str(int(row["answer"]) + 1)


def encode_example(tokenizer, row: dict, answer_text: str) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode(row["prompt"])
    answer = [*tokenizer.encode(answer_text), tokenizer.eos_token_id]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def sft(model, tokenizer, rows: list[dict], steps: int, batch: int, lr: float, seed: int, noise: float) -> list[float]:
    """Supervised next-token training on the answer tokens only (mislabelled targets, see `noisy_answer`)."""
    rng = random.Random(seed)
    encoded: dict[tuple[str, str], tuple[list[int], list[int]]] = {}  # the same few rows come back every step
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    columns = (*Progress.get_default_columns(), TextColumn("loss {task.fields[loss]}"))
    with Progress(*columns) as progress:  # a live bar on a terminal; its last state once in a log
        task = progress.add_task("supervised warm start", total=steps, loss="?")
        for step in range(steps):
            loss = sft_step(model, tokenizer, rows, optim, rng, batch, noise, encoded)
            for group in optim.param_groups:  # linear decay to 10 %
                group["lr"] = lr * (1 - 0.9 * step / max(steps - 1, 1))
            optim.step()
            losses.append(loss)
            if step % 20 == 0 or step == steps - 1:
                progress.update(task, loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            progress.advance(task)
    model.eval()
    return losses


def sft_step(
    model,
    tokenizer,
    rows: list[dict],
    optim,
    rng: random.Random,
    batch: int,
    noise: float,
    encoded: dict[tuple[str, str], tuple[list[int], list[int]]] | None = None,
) -> float:
    """One batch's loss and gradients (clipped); the caller sets the learning rate and steps the optimizer.
    `encoded` keeps each (prompt, answer) pair's tokens across steps (docs/benchmarks.md: about 1 s per 300 steps)."""
    encoded = {} if encoded is None else encoded
    picked = [rng.choice(rows) for _ in range(batch)]
    examples = []
    for key in [(row["prompt"], noisy_answer(row, rng, noise)) for row in picked]:  # the draws in the same order
        if key not in encoded:
            encoded[key] = encode_example(tokenizer, {"prompt": key[0]}, key[1])
        examples.append(encoded[key])
    width = max(len(t) for t, _ in examples)
    tokens = torch.full((batch, width), tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width))
    for i, (t, m) in enumerate(examples):
        tokens[i, : len(t)] = torch.tensor(t)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    logits = model(input_ids=tokens[:, :-1]).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    loss = -(logprobs * mask[:, 1:]).sum() / mask[:, 1:].sum()
    optim.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return float(loss.detach())


@torch.no_grad()
def greedy_answers(model, tokenizer, rows: list[dict], max_new: int = 5) -> list[str | None]:
    """Each problem's greedy completion, or None when it did not end with end-of-text within `max_new` tokens."""
    answers: list[str | None] = []
    for row in track(rows, description="held-out greedy answers"):
        prompt = tokenizer.encode(row["prompt"])
        ids, stopped = torch.tensor([prompt]), False
        for _ in range(max_new):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                stopped = True
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        answers.append(tokenizer.decode(ids[0, len(prompt) :]).strip() if stopped else None)
    return answers


def fleetrl_sft(out: Path, model_dir: Path, train: list[dict], args: argparse.Namespace) -> list[float]:
    """`fleetrl sft examples/arithmetic/sft.toml` on this run's rows and model (the HF export replaces the model
    folder's weights); the per-step losses from its metrics.jsonl."""
    from fleetrl.commands.sft import main as sft_main

    with open(out / "sft.jsonl", "w") as fh:
        rows = sft_rows(train, args.steps, args.batch, args.seed, args.noise)
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    log_path = out / "sft"
    overrides = {
        "base_model": model_dir,
        "log_path": log_path,
        "output_dir": model_dir,
        "max_steps": args.steps,
        "learning_rate": args.lr,
        "seed": args.seed,
        "sft.dataset": out / "sft.jsonl",
        "sft.batch_size": args.batch,
    }
    config = Path(__file__).resolve().parent / "sft.toml"
    argv = [
        str(config),
        *(f"--set={k}={json.dumps(str(v)) if isinstance(v, Path) else v}" for k, v in overrides.items()),
    ]
    if sft_main([*argv, "--device", "cpu"]) != 0:
        raise SystemExit("fleetrl sft failed")
    records = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["train/loss"] for r in records if "train/loss" in r]


def sft_rows(rows: list[dict], steps: int, batch: int, seed: int, noise: float) -> list[dict]:
    """The supervised rows in the order the script's loop draws them (`sft_step`): `steps` batches of `batch`
    problems, each with its (noisy) answer; `fleetrl sft` reads them in this order (shuffle = false)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        picked = [rng.choice(rows) for _ in range(batch)]
        out.extend({"prompt": row["prompt"], "completion": noisy_answer(row, rng, noise)} for row in picked)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/arithmetic/init", help="output folder (model + data)")
    parser.add_argument("--steps", type=int, default=2000, help="supervised steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--noise", type=float, default=0.7, help="fraction of targets that are off by one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--loop", choices=("fleetrl_sft", "script"), default="fleetrl_sft", help="who trains (see the docstring)"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # bit-for-bit repeatable on one machine
    out = Path(args.out)
    t0 = time.monotonic()
    model_dir = build_tiny_model(
        out / "model",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
        seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train, held_out = split_rows(args.seed)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(out / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    if args.loop == "script":
        losses = sft(model, tokenizer, train, args.steps, args.batch, args.lr, args.seed, args.noise)
        model.save_pretrained(model_dir)
    else:
        losses = fleetrl_sft(out, model_dir, train, args)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answers = greedy_answers(model, tokenizer, held_out)
    right = sum(a == r["answer"] for a, r in zip(answers, held_out, strict=True)) / len(held_out)
    plus_one = sum(a == str(int(r["answer"]) + 1) for a, r in zip(answers, held_out, strict=True)) / len(held_out)
    print(
        f"warm start: {args.steps} steps, final loss {sum(losses[-20:]) / 20:.3f}, held-out greedy accuracy "
        f"{right:.3f} (answers the sum plus one: {plus_one:.3f}), {time.monotonic() - t0:.0f} s -> {model_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
