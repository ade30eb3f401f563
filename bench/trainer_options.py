"""The GPU figures of issue 40 item 2: Liger kernels, per-layer compile and selective checkpointing, side by side.

Command (from the repository root, on a CUDA machine with the `liger` extra installed):

    python bench/trainer_options.py [--preset 1.5b] [--tokens 8192] [--samples 8] [--steps 3] [--json out.json]

A random-init Qwen2-shaped model (`--preset`: Qwen2.5-1.5B's shape, or `small` for a try) in float32 under bfloat16
autocast (the one-process trainer's mixed precision) trains one packed micro-batch (`--samples` samples, `--tokens`
in all) through the trainer's forward (fleetrl.trainer.logprobs.packed_logprobs) and backward, for each arm: the
model's own modules with whole-layer checkpointing (the default), Liger's kernels, compiled layers, both, and the
checkpointing options. Per arm: tokens/s over `--steps` timed steps after a warm-up (compile happens there), the peak
of torch.cuda.max_memory_allocated, and, against the first arm, the largest logprob difference and the largest
gradient difference relative to the largest gradient entry (bfloat16 compute: expect about 1e-2, not 0).
Arms that cannot run here (Liger without CUDA or the package) are reported as skipped. On CPU it runs the other arms
for a try (no memory figure).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESETS: dict[str, dict[str, Any]] = {
    "1.5b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "small": {
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
}
# name: (liger, compile, checkpointing every, scope); every 0 = no checkpointing.
ARMS: dict[str, tuple[bool, bool, int, str]] = {
    "own modules, layer checkpointing": (False, False, 1, "layer"),
    "liger": (True, False, 1, "layer"),
    "compiled layers": (False, True, 1, "layer"),
    "liger + compiled layers": (True, True, 1, "layer"),
    "no checkpointing": (False, False, 0, "layer"),
    "checkpointing every 2nd layer": (False, False, 2, "layer"),
    "checkpointing attention only": (False, False, 1, "attention"),
    "checkpointing mlp only": (False, False, 1, "mlp"),
}


def measure(arm: str, preset: str, tokens: int, samples: int, steps: int, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fleetrl.trainer.kernels import choose_kernels
    from fleetrl.trainer.layers import CheckpointPlan
    from fleetrl.trainer.logprobs import pack, packed_logprobs
    from fleetrl.trainer.model import ModelOptions, apply_model_options

    liger, compiled, every, scope = ARMS[arm]
    torch._dynamo.reset()  # each arm compiles its own model
    dev = torch.device(device)
    kernels = choose_kernels(True, dev) if liger else None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(max_position_embeddings=32768, **PRESETS[preset]))
    model.to(dev).train()
    model.config.use_cache = False
    plan = CheckpointPlan(every, scope) if every else None
    apply_model_options(model, ModelOptions(checkpointing=plan, kernels=kernels, compile_layers=compiled))
    gen = torch.Generator().manual_seed(1)
    length = tokens // samples
    vocab = PRESETS[preset]["vocab_size"]
    seqs = [torch.randint(0, vocab, (length + 1,), generator=gen).tolist() for _ in range(samples)]
    batch = pack([s[:-1] for s in seqs], [s[1:] for s in seqs]).to(dev)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logprobs, _ = packed_logprobs(model, batch, entropy=True)
        (-logprobs.mean()).backward()
        return logprobs.detach().float()

    logprobs = step()  # warm-up (and compile)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        logprobs = step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / (1 << 30) if dev.type == "cuda" else None,
        "logprobs": logprobs.cpu(),
        "grads": grads,
    }


def main() -> None:
    import torch

    from fleetrl.trainer.kernels import liger_available

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.5b", choices=sorted(PRESETS))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] | None = None
    print(f"{args.preset}, {args.tokens} tokens in {args.samples} samples, {args.device}")
    print("| arm | tokens/s | peak GiB | max logprob diff | max grad diff (rel.) |")
    print("|---|---|---|---|---|")
    for arm, (liger, *_rest) in ARMS.items():
        if liger and (args.device != "cuda" or not liger_available()):
            rows[arm] = {"skipped": "Liger needs CUDA and the liger extra"}
            print(f"| {arm} | skipped | | | |", flush=True)
            continue
        m = measure(arm, args.preset, args.tokens, args.samples, args.steps, args.device)
        if reference is None:
            reference = m
        lp_diff = float((m["logprobs"] - reference["logprobs"]).abs().max())
        scale = max(float(g.abs().max()) for g in reference["grads"].values())
        grad_diff = max(float((m["grads"][n] - g).abs().max()) for n, g in reference["grads"].items()) / scale
        peak = "n/a" if m["peak_gib"] is None else f"{m['peak_gib']:.1f}"
        rows[arm] = {k: m[k] for k in ("tokens_per_s", "step_s", "peak_gib")}
        rows[arm].update(max_logprob_diff=lp_diff, max_grad_diff_rel=grad_diff)
        print(f"| {arm} | {m['tokens_per_s']:,.0f} | {peak} | {lp_diff:.2e} | {grad_diff:.2e} |", flush=True)
        del m
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "machine": platform.platform()}))


if __name__ == "__main__":
    main()
