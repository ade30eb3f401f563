"""Peak memory per rank when two FSDP2 ranks load a model for a LoRA run: whole (every rank loads the whole model,
wraps it in its adapter, then shards it: the LoRA path before issue 40) vs sharded (built on meta, wrapped on meta,
sharded, each rank reads only its own rows of the base and of the adapter: fleetrl/trainer/sharded_load.py).

Command (from the repository root):

    python bench/lora_sharded_load.py [--preset small] [--repeats 2] [--rank 16] [--json out.json]

The model is bench/sharded_load.py's (a random-init Qwen2-shaped model of the preset's shape, bfloat16 on disk),
loaded in float32 (the trainer's master dtype), the adapter on every linear layer (`all-linear`). The two arms run
interleaved (whole, sharded, whole, ...), each as two fresh gloo ranks on loopback. Per rank: the peak resident memory
while loading (VmHWM, reset just before), relative to the rank's RSS just before loading (after imports and the
process group). Medians over the repeats of the larger rank.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sharded_load import PRESETS, _free_port, _status_kb, warm_up_imports, write_model

WORLD = 2
ARMS = ("whole", "sharded")


def _rank(rank: int, port: int, model_dir: str, arm: str, lora_rank: int, out: str) -> None:
    import os

    import torch

    from fleetrl import Config
    from fleetrl.trainer import lora
    from fleetrl.trainer.distributed import DistContext, destroy, shard_model
    from fleetrl.trainer.model import load_causal_lm
    from fleetrl.trainer.sharded_load import load_sharded_causal_lm

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = DistContext.from_env(device="cpu", timeout_s=600)
    try:
        cfg = Config(base_model=model_dir, log_path=out, lora_rank=lora_rank)
        warm_up_imports(model_dir)
        lora.wrap_with_lora(_one_layer_model(model_dir), cfg)  # PEFT's imports and first use in the baseline
        shard = partial(shard_model, device=torch.device("cpu"), world_size=WORLD)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        before_kb = _status_kb("VmRSS")
        start = time.perf_counter()
        if arm == "sharded":
            model = load_sharded_causal_lm(
                model_dir,
                shard,
                wrap=partial(lora.wrap_with_lora, cfg=cfg),
                start_tensors=partial(lora.adapter_start_tensors, cfg=cfg),
            )
        else:
            model = lora.wrap_with_lora(load_causal_lm(model_dir), cfg)
            shard(model)
        seconds = time.perf_counter() - start
        figures = {
            "peak_growth_mb": (_status_kb("VmHWM") - before_kb) / 1024,
            "held_growth_mb": (_status_kb("VmRSS") - before_kb) / 1024,
            "seconds": seconds,
        }
        Path(f"{out}/{arm}-{rank}.json").write_text(json.dumps(figures))
        del model
    finally:
        destroy(ctx)


def _one_layer_model(model_dir: str) -> Any:
    """A one-layer, small-vocabulary model of the same config with random weights (imports only)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers, config.vocab_size = 1, 256
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def run(preset: str, repeats: int, lora_rank: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = write_model(Path(tmp) / "model", preset)
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for i in range(repeats):
            for arm in ARMS:
                mp.spawn(_rank, args=(_free_port(), model_dir, arm, lora_rank, tmp), nprocs=WORLD, join=True)
                ranks = [json.loads((Path(tmp) / f"{arm}-{r}.json").read_text()) for r in range(WORLD)]
                worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
                runs[arm].append(worst)
                print(f"run {i} {arm}: {worst}", flush=True)
    median = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in runs.items()}
    return {
        "preset": preset,
        "parameters": params,
        "lora_rank": lora_rank,
        "ranks": WORLD,
        "repeats": repeats,
        "median_of_larger_rank": median,
        "runs": runs,
        "machine": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = run(args.preset, args.repeats, args.rank)
    m = result["median_of_larger_rank"]
    print(f"{result['parameters'] / 1e6:.0f}M parameters, float32, LoRA rank {args.rank}, {WORLD} gloo ranks")
    print("| arm | peak growth per rank (MB) | held after load (MB) | load s |")
    print("|---|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {m[arm]['peak_growth_mb']:.0f} | {m[arm]['held_growth_mb']:.0f} | {m[arm]['seconds']:.1f} |")
    print(f"sharded / whole peak: {m['sharded']['peak_growth_mb'] / m['whole']['peak_growth_mb']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
