"""Peak memory and compute of one forward/backward under each activation-checkpointing option (issue 40): none,
whole layers (every layer, every 2nd), attention only, MLP only (fleetrl/trainer/layers.py).

Command (from the repository root):

    python bench/activation_checkpointing.py [--tokens 2048] [--samples 8] [--rounds 2] [--json out.json]

A random-init Qwen2-shaped model (hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1536, vocabulary 8192, float32:
32.5M parameters) trains one packed micro-batch (`--samples` samples of equal length, `--tokens` in all) through the
trainer's own forward (fleetrl.trainer.logprobs.packed_logprobs, chunked head) and backward. Each arm runs in a fresh
process with one torch thread; arms interleaved, `--rounds` rounds, medians. Peak: the process's peak resident memory
(VmHWM, reset just before the forward) minus its RSS just before, i.e. what the forward/backward adds on top of the
weights: activations kept for backward, recomputed ones, gradients. CPU seconds: process time of the
forward/backward (a shared machine disturbs it less than wall time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS: dict[str, tuple[int, str] | None] = {
    "none": None,
    "layer, every layer": (1, "layer"),
    "layer, every 2nd layer": (2, "layer"),
    "attention only": (1, "attention"),
    "mlp only": (1, "mlp"),
}
SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _arm(name: str, tokens: int, samples: int, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fleetrl.trainer.layers import CheckpointPlan
    from fleetrl.trainer.logprobs import pack, packed_logprobs
    from fleetrl.trainer.model import ModelOptions, apply_model_options

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    plan = ARMS[name]
    apply_model_options(model, ModelOptions(checkpointing=None if plan is None else CheckpointPlan(*plan)))
    length = tokens // samples
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (length + 1,), generator=gen).tolist() for _ in range(samples)]
    batch = pack([s[:-1] for s in seqs], [s[1:] for s in seqs])
    # Warm-up on a short row (first-call allocations and dispatch caches), then the gradients' own memory exists.
    small = pack([s[:9] for s in seqs[:2]], [s[1:10] for s in seqs[:2]])
    packed_logprobs(model, small)[0].sum().backward()
    Path("/proc/self/clear_refs").write_text("5")
    before_kb = _status_kb("VmRSS")
    cpu = time.process_time()
    logprobs, _ = packed_logprobs(model, batch)
    (-logprobs.mean()).backward()
    cpu = time.process_time() - cpu
    figures = {"peak_growth_mb": (_status_kb("VmHWM") - before_kb) / 1024, "cpu_s": cpu}
    Path(out).write_text(json.dumps(figures))


def run(tokens: int, samples: int, rounds: int) -> dict[str, Any]:
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for name in ARMS:
                out = f"{tmp}/{i}-{len(runs[name])}.json"
                proc = ctx.Process(target=_arm, args=(name, tokens, samples, out))
                proc.start()
                proc.join(timeout=1800)
                if proc.exitcode != 0:
                    raise RuntimeError(f"arm {name!r} exited with {proc.exitcode}")
                runs[name].append(json.loads(Path(out).read_text()))
                print(f"round {i} {name}: {runs[name][-1]}", flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    return {
        "shape": SHAPE,
        "tokens": tokens,
        "samples": samples,
        "rounds": rounds,
        "median": median,
        "runs": runs,
        "machine": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.tokens, args.samples, args.rounds)
    m = result["median"]
    print(f"{args.tokens} tokens in {args.samples} samples, 32.5M-parameter Qwen2 shape, float32, 1 thread")
    print("| checkpointing | peak added by forward/backward (MB) | CPU s |")
    print("|---|---|---|")
    for name in ARMS:
        print(f"| {name} | {m[name]['peak_growth_mb']:.0f} | {m[name]['cpu_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
