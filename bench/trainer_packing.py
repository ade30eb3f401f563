"""Trainer speed and memory on long-tailed RL batches: padded vs packed micro-batches, full vs chunked logprobs.

    python bench/trainer_packing.py throughput [--vocab 16384] [--rounds 3] [--json out.json]
    python bench/trainer_packing.py memory [--vocab 151936] [--json out.json]

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
"""

from __future__ import annotations

import argparse
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


def build_model(out: Path, *, vocab: int, hidden: int, layers: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["throughput", "memory", "_memory_child"])
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm")
    parser.add_argument("--model-dir")
    parser.add_argument("--workdir")
    args = parser.parse_args(argv)
    if args.mode == "_memory_child":
        memory_child(args)
        return 0
    if args.vocab is None:
        args.vocab = 16384 if args.mode == "throughput" else 151936
    result = throughput(args) if args.mode == "throughput" else memory(args)
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
