"""Trainer speed and memory on long-tailed RL batches: padded vs packed micro-batches, full vs chunked logprobs.

    python bench/trainer_packing.py throughput [--vocab 16384] [--rounds 3] [--json out.json]
    python bench/trainer_packing.py memory [--vocab 151936] [--json out.json]
    python bench/trainer_packing.py paths [--rounds 7] [--threads 1] [--json out.json]

`throughput`: one step of 16 samples whose lengths are long-tailed as RL completions are (one of 4096 tokens, a
few of 256-1536, most of 32-128: 7,696 trained positions), trained by
`PolicyTrainer.train_step` on a random Qwen2-shaped model (hidden 256, 4 layers) in two configurations, rounds
interleaved after one warm-up each (a shared machine drifts; interleaving keeps the comparison fair; process CPU
seconds are reported beside wall seconds, steadier when other work shares the machine):
- padded (before): right-padded micro-batches of 4 samples, full [B, T, V] logits (packing = false,
  logprob_chunk_tokens = 0);
- packed (after): samples packed into micro-batches of at most 8,192 tokens, logprobs in chunks of 1,024 positions
  (the defaults).
Reported: real tokens per second (padding not counted), median of the rounds. The 16 samples are 4 groups of 4 in
row order, so padded micro-batches of 4 pad each group to its longest (17,984 positions for 7,696 tokens).

`memory`: the peak RSS of a process that trains one step of 16 x 2048 tokens at a 152k vocabulary (hidden 64,
2 layers: the vocabulary dominates), each configuration in its own fresh process (peak RSS only grows):
- full logprobs: micro-batches of 4,096 tokens, full logits (logprob_chunk_tokens = 0);
- chunked logprobs: the same micro-batches, 1,024 positions at a time;
and, for scale, what the old default (the rank's whole share in one padded forward) would allocate for its logits.

`paths`: which row layout and packed-attention path is fastest on this device, per micro-batch shape: one
forward/backward (`InnerLoop.accumulate_gradients`, the trainer's own code) of one micro-batch through padded rows
(one causal sdpa call over [B, T]), and through a packed row with each of `varlen_sdpa`'s paths (one sdpa call per
sample, one per length bucket, one under a block-diagonal mask), plus the trainer's automatic choice. Shapes: the
main job's (128 samples of 7-15 tokens on the arithmetic model: hidden 128, 4 layers, vocabulary 512), the
long-tailed 16 samples above and 4 x 1024 tokens, on the same model. Arms interleaved, `--rounds` rounds after a
warm-up, median wall and process CPU seconds; sdpa calls per forward and backward are counted. The rule in
fleetrl.trainer.varlen_attention.choose_packed_attention and fleetrl.trainer.inner_loop.choose_rows comes from
these numbers (docs/trainer.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LONG_TAIL = [4096, 1536, 512, 384, 256, 192, 128, 128, 96, 96, 64, 64, 48, 48, 32, 32]
PROMPT = 16

ARMS = {
    "padded": {"packing": False, "logprob_chunk_tokens": 0, "micro_batch_tokens": None},
    "packed": {"packing": True, "logprob_chunk_tokens": 1024, "micro_batch_tokens": 8192},
    "full_logprobs": {"packing": True, "logprob_chunk_tokens": 0, "micro_batch_tokens": 4096},
    "chunked_logprobs": {"packing": True, "logprob_chunk_tokens": 1024, "micro_batch_tokens": 4096},
}


def build_model(out: Path, *, vocab: int, hidden: int, layers: int, intermediate: int | None = None) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return str(out)


def groups_of(lengths: list[int], vocab: int, seed: int = 0) -> list:
    import random

    from fleetrl.rollout import RolloutSample
    from fleetrl.rollout_group import RolloutGroup

    rng = random.Random(seed)
    groups = []
    for g in range(len(lengths) // 4):
        samples = []
        for i, n in enumerate(lengths[4 * g : 4 * g + 4]):
            mask = [0] * PROMPT + [1] * (n - PROMPT)
            samples.append(
                RolloutSample(
                    [rng.randrange(vocab) for _ in range(n)], [-1.0 if m else 0.0 for m in mask], mask, float(i % 2)
                )
            )
        groups.append(RolloutGroup(g, 0, samples))
    return groups


def make_trainer(model_dir: str, workdir: str, arm: str, micro_batch_size: int | None = None):
    from fleetrl import Config
    from fleetrl.trainer import PolicyTrainer

    cfg = Config(
        base_model=model_dir,
        log_path=workdir,
        completions_per_prompt=4,
        prompt_groups_per_step=len(LONG_TAIL) // 4,
        max_completion_tokens=8000,
        max_seq_len=8192,
        kl_beta=0.0,
        **ARMS[arm],
    )
    # The same groups every round: no staleness refusal (no controller here).
    return PolicyTrainer(cfg, micro_batch_size=micro_batch_size, refuse_stale=False)


def throughput(args: argparse.Namespace) -> dict:
    import torch

    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="fleetrl-packing-"))
    model_dir = build_model(work / "model", vocab=args.vocab, hidden=256, layers=4)
    groups = groups_of(LONG_TAIL, args.vocab)
    real_tokens = sum(n - 1 for n in LONG_TAIL)
    trainers = {
        "padded": make_trainer(model_dir, str(work / "padded"), "padded", micro_batch_size=4),
        "packed": make_trainer(model_dir, str(work / "packed"), "packed"),
    }
    from fleetrl.trainer.row_set import RowIdSet

    times: dict[str, list[float]] = {arm: [] for arm in trainers}
    cpu: dict[str, list[float]] = {arm: [] for arm in trainers}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for arm, trainer in trainers.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            trainer.train_step([g for g in groups], step=trainer.steps_done + 1)
            trainer._trained_rows = RowIdSet()  # the same rows every round
            wall, used = time.perf_counter() - started, time.process_time() - cpu_started
            if round_:
                times[arm].append(wall)
                cpu[arm].append(used)
            print(f"round {round_} {arm}: {wall:.2f} s wall, {used:.2f} s CPU", flush=True)
    padded_width = sum(max(LONG_TAIL[i : i + 4]) * 4 for i in range(0, 16, 4))
    out = {
        "vocab": args.vocab,
        "real_tokens": real_tokens,
        "padded_positions": padded_width,
        "tokens_per_s": {arm: real_tokens / statistics.median(t) for arm, t in times.items()},
        "step_s": {arm: statistics.median(t) for arm, t in times.items()},
        "step_cpu_s": {arm: statistics.median(t) for arm, t in cpu.items()},
        "attention": {arm: trainer.loop.attention for arm, trainer in trainers.items()},
    }
    out["speedup"] = out["tokens_per_s"]["packed"] / out["tokens_per_s"]["padded"]
    return out


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def memory_child(args: argparse.Namespace) -> None:
    """One step in this fresh process; prints JSON with the RSS before the step and the peak."""
    trainer = make_trainer(args.model_dir, args.workdir, args.arm)
    groups = groups_of([2048] * 16, args.vocab)
    # This process's own peak (VmHWM, reset here): ru_maxrss keeps the high-water mark of the parent across exec.
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_mb()
    trainer.train_step(groups)
    peak = _status_mb("VmHWM")
    print(json.dumps({"arm": args.arm, "rss_before_step_mb": before, "peak_rss_mb": peak}))


def memory(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fleetrl-logprob-mem-"))
    model_dir = build_model(work / "model", vocab=args.vocab, hidden=64, layers=2)
    results = {}
    for arm in ("full_logprobs", "chunked_logprobs"):
        cmd = [sys.executable, __file__, "_memory_child", "--arm", arm, "--vocab", str(args.vocab)]
        cmd += ["--model-dir", model_dir, "--workdir", str(work / arm)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
        results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(results[arm], flush=True)
    tokens = 16 * 2047
    results["old_default_logits_gb"] = tokens * args.vocab * 4 / 1e9  # one padded forward of the whole share
    results["vocab"] = args.vocab
    return results


PATH_SHAPES = {
    "main job: 128 x 7-15": None,  # filled by paths(): seeded random lengths
    "long tail: 16 samples, 32-4096": LONG_TAIL,
    "4 x 1024": [1024] * 4,
}
PATH_ARMS = ("padded", "sample_loop", "bucketed_sdpa", "block_mask_sdpa", "auto")


def _count_sdpa() -> tuple[list[int], object]:
    """Wrap torch's sdpa to count its calls; returns the counter and the original to restore."""
    import torch.nn.functional as F

    calls, original = [0], F.scaled_dot_product_attention

    def counted(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    F.scaled_dot_product_attention = counted
    return calls, original


def paths(args: argparse.Namespace) -> dict:
    import random

    import torch
    import torch.nn.functional as F

    from fleetrl.trainer import varlen_attention as va
    from fleetrl.trainer.datum import Datum

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    shapes = dict(PATH_SHAPES)
    shapes["main job: 128 x 7-15"] = [rng.randint(7, 15) for _ in range(128)]
    work = Path(tempfile.mkdtemp(prefix="fleetrl-paths-"))
    model_dir = build_model(work / "model", vocab=512, hidden=128, layers=4, intermediate=256)
    results: dict = {"threads": args.threads, "shapes": {}}
    calls, original = _count_sdpa()
    try:
        for label, lengths in shapes.items():
            datums = [
                Datum(
                    [rng.randrange(512) for _ in range(n)],
                    [rng.randrange(512) for _ in range(n)],
                    [0] * (n // 3) + [1] * (n - n // 3),
                    [-1.0] * n,
                )
                for n in lengths
            ]
            advantages = torch.tensor([float(i % 2) - 0.5 for i in range(len(datums))])
            trainers = {
                arm: make_trainer(model_dir, str(work / arm), "padded" if arm == "padded" else "packed")
                for arm in PATH_ARMS
            }
            for trainer in trainers.values():
                trainer.loop.micro_batch_tokens = None  # the whole shape is one micro-batch
            times: dict[str, list[float]] = {arm: [] for arm in trainers}
            cpu: dict[str, list[float]] = {arm: [] for arm in trainers}
            sdpa_calls: dict[str, int] = {}
            for round_ in range(args.rounds + 1):
                for arm, trainer in trainers.items():
                    forced = va.forced_path(arm) if arm in va.PACKED_PATHS else contextlib.nullcontext()
                    calls[0] = 0
                    with forced:
                        started, cpu_started = time.perf_counter(), time.process_time()
                        trainer.loop.accumulate_gradients(datums, advantages, list(range(len(datums))))
                        wall, used = time.perf_counter() - started, time.process_time() - cpu_started
                    trainer.model.zero_grad(set_to_none=True)
                    sdpa_calls[arm] = calls[0]
                    if round_:
                        times[arm].append(wall)
                        cpu[arm].append(used)
            row = {arm: statistics.median(t) for arm, t in times.items()}
            row_cpu = {arm: statistics.median(t) for arm, t in cpu.items()}
            results["shapes"][label] = {
                "tokens": sum(lengths),
                "padded_positions": len(lengths) * max(lengths),
                "fwd_bwd_s": row,
                "fwd_bwd_cpu_s": row_cpu,
                "sdpa_calls_fwd_bwd": sdpa_calls,
            }
            cells = ", ".join(
                f"{arm} {row[arm] * 1e3:.1f} ms wall, {row_cpu[arm] * 1e3:.1f} ms CPU ({sdpa_calls[arm]} sdpa)"
                for arm in row
            )
            print(f"{label}: {cells}", flush=True)
    finally:
        F.scaled_dot_product_attention = original
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["throughput", "memory", "paths", "_memory_child"])
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (paths; fleetrl up's trainer on 2 cores)")
    parser.add_argument("--arm")
    parser.add_argument("--model-dir")
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)
    if args.mode == "_memory_child":
        memory_child(args)
        return 0
    if args.vocab is None:
        args.vocab = 16384 if args.mode == "throughput" else 151936
    modes = {"throughput": throughput, "memory": memory, "paths": paths}
    result = modes[args.mode](args)
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
