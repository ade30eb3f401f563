"""Trainer step time, full fine-tuning vs LoRA: `PolicyTrainer.train_step` on the same batch and model.

    python bench/lora_step_time.py [--sizes tiny,100m] [--rank 16] [--rounds 5] [--json out.json]

For each model size a model is built locally (fleetrl.tiny_model; no download) and a fixed batch of synthetic
groups is made. Two trainers load it: full fine-tuning (lora_rank 0) and LoRA (lora_rank = --rank, all linear
layers of the decoder, alpha 2r). Each step is the public `train_step(groups)` (grpo, kl_beta 0, one minibatch,
no weight publishing): step building, the logprob forward with entropy, loss, backward, grad clipping, AdamW and
the LR scheduler. Rounds alternate full / LoRA (after one warm-up each) so both see the same machine load; the
median round is reported in wall-clock and process CPU seconds (and the median of each round's LoRA / full CPU
seconds, steadier when other jobs share the cores), with the trainable parameter count and the AdamW
state each keeps (2 float32 moments per trainable parameter).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainer_sizes import SIZES, bench_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per path (after 1 warm-up)")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def _bench_size(name: str, rank: int, rounds: int, workdir: Path) -> dict:
    from fleetrl.rollout_group import RolloutGroup
    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer.synthetic import synthetic_groups

    shape, P, G, prompt_len, completion_len = SIZES[name]
    model_dir = build_tiny_model(workdir / name, **shape)

    def trainer(lora_rank: int) -> PolicyTrainer:
        cfg = bench_config(model_dir, workdir / f"{name}-r{lora_rank}", name, lora_rank=lora_rank)
        return PolicyTrainer(cfg)

    trainers = {"full": trainer(0), "lora": trainer(rank)}
    base = trainers["full"].model
    n_params = sum(p.numel() for p in base.parameters())
    groups = synthetic_groups(
        num_groups=P,
        group_size=G,
        vocab_size=base.config.vocab_size,
        prompt_len=prompt_len,
        completion_len=completion_len,
        seed=0,
        model=base,
    )
    tokens = sum(len(s.tokens) - 1 for g in groups for s in g.samples)
    next_row = [0]

    def step(which: str) -> tuple[float, float]:
        fresh = []  # new row ids each time: the trainer never trains a row twice
        for g in groups:
            fresh.append(RolloutGroup(next_row[0], 0, copy.deepcopy(g.samples)))
            next_row[0] += 1
        started, cpu_started = time.perf_counter(), time.process_time()
        trainers[which].train_step(fresh)
        return time.perf_counter() - started, time.process_time() - cpu_started

    step("full"), step("lora")  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"full": [], "lora": []}
    for _ in range(rounds):
        for which in ("full", "lora"):
            times[which].append(step(which))
    result: dict = {
        "size": name,
        "params_m": round(n_params / 1e6, 1),
        "rank": rank,
        "batch": f"{P}x{G} samples, {tokens} tokens",
    }
    for which, t in trainers.items():
        trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
        result[f"{which}_trainable"] = trainable
        result[f"{which}_adam_state_mb"] = round(2 * 4 * trainable / 1e6, 2)
        result[f"{which}_s"] = statistics.median(s for s, _ in times[which])
        result[f"{which}_cpu_s"] = statistics.median(c for _, c in times[which])
        result[f"{which}_times"] = times[which]
    # Paired by round (each LoRA step right after a full one): robust to load that drifts over minutes.
    pairs = list(zip(times["full"], times["lora"], strict=True))
    result["paired_cpu_ratio"] = statistics.median(lora[1] / full[1] for full, lora in pairs)
    result["lora_over_full"] = result["lora_s"] / result["full_s"]
    result["lora_over_full_cpu"] = result["lora_cpu_s"] / result["full_cpu_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"unknown sizes {unknown}; choose from {sorted(SIZES)}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            result = _bench_size(size, args.rank, args.rounds, Path(tmp))
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if not k.endswith("_times")}), flush=True)
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(
        "| model | batch | full: trainable / AdamW state | LoRA: trainable / AdamW state | full step s (CPU s) "
        "| LoRA step s (CPU s) | LoRA / full (wall) | LoRA / full (CPU s, paired) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['size']} ({r['params_m']}M params), r={r['rank']} | {r['batch']} | "
            f"{r['full_trainable'] / 1e6:.1f}M / {r['full_adam_state_mb']:.0f} MB | "
            f"{r['lora_trainable'] / 1e6:.2f}M / {r['lora_adam_state_mb']:.1f} MB | "
            f"{r['full_s']:.3f} ({r['full_cpu_s']:.3f}) | {r['lora_s']:.3f} ({r['lora_cpu_s']:.3f}) | "
            f"{100 * r['lora_over_full']:.0f}% | {100 * r['paired_cpu_ratio']:.0f}% |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
