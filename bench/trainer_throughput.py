"""Trainer throughput: tokens/s of `PolicyTrainer.train_step` (forward + backward + optimizer step) vs a bare
PyTorch loop doing the same forward, loss, backward and AdamW step on the same model and batch.

    python bench/trainer_throughput.py [--sizes tiny,50m] [--rounds 5] [--json out.json]

For each model size a model is built locally (fleetrl.tiny_model; no download) and a fixed batch of
synthetic groups (P groups of G samples, prompt + completion) is made. The trainer path is the public
`train_step(groups)` with `policy_loss = "grpo"`, kl_beta 0, num_minibatches 1, no weight publishing: it
includes step building (advantages, datums, padding), the logprob forward with entropy, the loss and its
metrics, backward, grad-norm clipping, AdamW and the LR scheduler. The bare loop runs, on pre-padded tensors,
model(input_ids).logits -> fleetrl.trainer.datum.gather_target_logprobs -> fleetrl.losses.policy_loss("grpo") ->
backward -> AdamW.step -> zero_grad, nothing else. Both count the same tokens (input positions, N-1 per
sample). Rounds alternate between the two (after one warm-up each), each on its own copy of the model;
the median round is reported, in wall-clock seconds (tokens/s) and in process CPU seconds (steadier on a
shared machine). Goal: the trainer keeps >= 90 % of the bare loop's tokens/s.
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
    parser.add_argument("--sizes", default="tiny,50m", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per path (after 1 warm-up)")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def _bench_size(name: str, rounds: int, workdir: Path) -> dict:
    import torch

    from fleetrl.losses import policy_loss
    from fleetrl.rollout_group import RolloutGroup
    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer.datum import gather_target_logprobs, samples_to_batch
    from fleetrl.trainer.model import load_causal_lm
    from fleetrl.trainer.step_batch import build_step_batch
    from fleetrl.trainer.synthetic import synthetic_groups

    shape, P, G, prompt_len, completion_len = SIZES[name]
    model_dir = build_tiny_model(workdir / name, **shape)
    cfg = bench_config(model_dir, workdir / f"{name}-run", name)
    trainer = PolicyTrainer(cfg)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    groups = synthetic_groups(
        num_groups=P,
        group_size=G,
        vocab_size=trainer.model.config.vocab_size,
        prompt_len=prompt_len,
        completion_len=completion_len,
        seed=0,
        model=trainer.model,
    )
    tokens = sum(len(s.tokens) - 1 for g in groups for s in g.samples)

    # The bare loop: its own copy of the same weights, the same batch pre-padded, the same loss.
    bare_model = load_causal_lm(str(model_dir))
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=cfg.learning_rate)
    step_batch = build_step_batch(groups)
    batch = samples_to_batch(step_batch.samples)
    advantages = torch.tensor(step_batch.advantages)

    def bare_step() -> tuple[float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        logits = bare_model(input_ids=batch.input_tokens_BT).logits
        logprobs = gather_target_logprobs(logits, batch.target_tokens_BT)
        loss, _ = policy_loss("grpo", logprobs, logprobs.detach(), batch.rollout_logprobs_BT, advantages, batch.mask_BT)
        loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - started, time.process_time() - cpu_started

    next_row = [0]

    def trainer_step() -> tuple[float, float]:
        fresh = []  # new row ids each time: the trainer never trains a row twice
        for g in groups:
            fresh.append(RolloutGroup(next_row[0], 0, copy.deepcopy(g.samples)))
            next_row[0] += 1
        started, cpu_started = time.perf_counter(), time.process_time()
        trainer.train_step(fresh)
        return time.perf_counter() - started, time.process_time() - cpu_started

    trainer_step(), bare_step()  # warm-up
    trainer_times, bare_times = [], []
    for _ in range(rounds):
        trainer_times.append(trainer_step())
        bare_times.append(bare_step())
    trainer_s = statistics.median(t for t, _ in trainer_times)
    bare_s = statistics.median(t for t, _ in bare_times)
    trainer_cpu = statistics.median(c for _, c in trainer_times)
    bare_cpu = statistics.median(c for _, c in bare_times)
    return {
        "size": name,
        "params_m": round(n_params / 1e6, 1),
        "batch": f"{P}x{G} samples, {tokens} tokens",
        "tokens": tokens,
        "trainer_s": trainer_s,
        "bare_s": bare_s,
        "trainer_tokens_per_s": tokens / trainer_s,
        "bare_tokens_per_s": tokens / bare_s,
        "ratio": bare_s / trainer_s,
        "trainer_cpu_s": trainer_cpu,
        "bare_cpu_s": bare_cpu,
        "cpu_ratio": bare_cpu / trainer_cpu,
        "trainer_times": trainer_times,
        "bare_times": bare_times,
    }


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
            result = _bench_size(size, args.rounds, Path(tmp))
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if not k.endswith("_times")}), flush=True)
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print("| model | batch | bare loop tok/s | trainer tok/s | trainer / bare (wall) | trainer / bare (CPU s) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['size']} ({r['params_m']}M params) | {r['batch']} | {r['bare_tokens_per_s']:,.0f} | "
            f"{r['trainer_tokens_per_s']:,.0f} | {100 * r['ratio']:.0f}% | {100 * r['cpu_ratio']:.0f}% |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
