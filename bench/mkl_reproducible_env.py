"""What oneMKL's reproducibility settings cost a trainer step on the CPU: `fleetrl up`'s services get
`MKL_DYNAMIC=FALSE OMP_DYNAMIC=FALSE MKL_CBWR=AUTO` (fleetrl/up/cpu_threads.py); a process without them is the
before. Each arm is a new process (MKL reads the variables when it starts), the arms interleaved, round by round.

    python bench/mkl_reproducible_env.py [--rounds 3 --steps 30 --threads 2]

A child times `--steps` forward+backward passes of a random-init model (after 3 warm-up steps) and prints the
median step and a digest of the gradients, so the table also says whether the two arms compute the same bits.
Numbers in docs/benchmarks.md ("oneMKL's reproducibility settings").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetrl.up.cpu_threads import REPRODUCIBLE_MATH_ENV

SIZES = {  # name -> build_tiny_model arguments, and the batch (rows, tokens)
    "tiny (h64, 2 layers, vocab 512)": ({}, (8, 48)),
    "small (h512, 4 layers, vocab 8192)": (
        {
            "hidden_size": 512,
            "num_layers": 4,
            "num_heads": 8,
            "num_kv_heads": 2,
            "intermediate_size": 1408,
            "vocab_size": 8192,
        },
        (4, 256),
    ),
}


def child(model_dir: str, rows: int, tokens: int, steps: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens))
    times = []
    for i in range(steps + 3):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).mean().backward()
        if i >= 3:
            times.append(time.perf_counter() - started)
    digest = hashlib.sha1(b"".join(p.grad.numpy().tobytes() for p in model.parameters())).hexdigest()[:12]
    print(json.dumps({"ms": statistics.median(times) * 1000, "grads": digest}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, rows, tokens, steps = args.child
        child(model_dir, int(rows), int(tokens), int(steps))
        return
    from fleetrl.tiny_model import build_tiny_model

    base = {k: v for k, v in os.environ.items() if k not in REPRODUCIBLE_MATH_ENV}
    base["OMP_NUM_THREADS"] = str(args.threads)
    arms = {"without (before)": base, "with (fleetrl up)": {**base, **REPRODUCIBLE_MATH_ENV}}
    print("| model | arm | median step (ms), per round | gradients |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (shape, (rows, tokens)) in SIZES.items():
            model_dir = str(build_tiny_model(Path(tmp) / name.split()[0], **shape))
            seen: dict[str, list[dict]] = {arm: [] for arm in arms}
            for _ in range(args.rounds):
                for arm, env in arms.items():
                    argv = [sys.executable, __file__, "--child", model_dir, str(rows), str(tokens), str(args.steps)]
                    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=900)
                    seen[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for arm, results in seen.items():
                per_round = ", ".join(f"{r['ms']:.1f}" for r in results)
                print(f"| {name} | {arm} | {per_round} | {sorted({r['grads'] for r in results})} |")


if __name__ == "__main__":
    main()
