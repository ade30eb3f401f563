"""Peak memory per rank when two FSDP2 ranks load a model: whole (every rank loads it all, then shards it) vs sharded
(built on meta, each rank reads only its own rows: fleetrl/trainer/sharded_load.py). Issue 26.

Command (from the repository root):

    python bench/sharded_load.py [--preset qwen2.5-0.5b] [--repeats 2] [--dtype float32] [--json out.json]

Writes a random-init Qwen2-shaped model (the preset's config: Qwen2.5-0.5B's shape by default, 494M parameters,
tied embeddings, bfloat16 on disk as published checkpoints are) to a temp folder, then runs the two arms
interleaved (whole, sharded, whole, sharded, ...), each as two fresh gloo ranks on loopback loading it in the
trainer's dtype (float32 by default: fp32 master weights). Per rank: RSS before loading, the peak (ru_maxrss)
and RSS after loading; the growth figures are relative to the rank's RSS just before loading (after imports and
the process group), so the interpreter and torch are not counted. Medians over the repeats of the larger rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 2
ARMS = ("whole", "sharded")
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's shape.
    "qwen2.5-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    # A quick one for trying the script: ~110M parameters.
    "small": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def warm_up_imports(model_dir: str) -> None:
    """Import what loading the model imports (transformers' model classes, kernels, masks: ~200 MB of code and
    tables) by building a one-layer copy, so the baseline has it in both arms and the figures are the weights'."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers, config.vocab_size = 1, 256
    AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _rank(rank: int, port: int, model_dir: str, arm: str, dtype: str, out: str) -> None:
    import os

    import torch

    from fleetrl.trainer.distributed import DistContext, destroy, shard_model
    from fleetrl.trainer.model import load_causal_lm
    from fleetrl.trainer.sharded_load import load_sharded_causal_lm

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = DistContext.from_env(device="cpu", timeout_s=600)
    try:
        warm_up_imports(model_dir)
        shard = partial(shard_model, device=torch.device("cpu"), world_size=WORLD)
        before_kb = _status_kb("VmRSS")
        start = time.perf_counter()
        if arm == "sharded":
            model = load_sharded_causal_lm(model_dir, shard, dtype=dtype)
        else:
            model = load_causal_lm(model_dir, dtype=dtype)
            shard(model)
        seconds = time.perf_counter() - start
        figures = {
            "before_mb": before_kb / 1024,
            "peak_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024,
            "held_growth_mb": (_status_kb("VmRSS") - before_kb) / 1024,
            "held_anon_mb": _status_kb("RssAnon") / 1024,
            "seconds": seconds,
        }
        Path(f"{out}/{arm}-{rank}.json").write_text(json.dumps(figures))
        del model
    finally:
        destroy(ctx)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_model(out: Path, preset: str) -> tuple[str, int]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(max_position_embeddings=4096, **PRESETS[preset])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    return str(out), params


def run(preset: str, repeats: int, dtype: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = write_model(Path(tmp) / "model", preset)
        file_mb = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 1e6
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for i in range(repeats):
            for arm in ARMS:
                mp.spawn(_rank, args=(_free_port(), model_dir, arm, dtype, tmp), nprocs=WORLD, join=True)
                ranks = [json.loads((Path(tmp) / f"{arm}-{r}.json").read_text()) for r in range(WORLD)]
                worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
                runs[arm].append(worst)
                print(f"run {i} {arm}: {worst}", flush=True)
    median = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    return {
        "preset": preset,
        "parameters": params,
        "checkpoint_mb": round(file_mb),
        "dtype": dtype,
        "ranks": WORLD,
        "repeats": repeats,
        "median_of_larger_rank": median,
        "runs": runs,
        "machine": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.preset, args.repeats, args.dtype)
    m = result["median_of_larger_rank"]
    print(f"{result['parameters'] / 1e6:.0f}M parameters, {result['checkpoint_mb']} MB bf16 checkpoint, {args.dtype}")
    print("| arm | peak growth per rank (MB) | held after load (MB) | load s |")
    print("|---|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {m[arm]['peak_growth_mb']:.0f} | {m[arm]['held_growth_mb']:.0f} | {m[arm]['seconds']:.1f} |")
    print(f"sharded / whole peak: {m['sharded']['peak_growth_mb'] / m['whole']['peak_growth_mb']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
