"""LoRA push benchmark: bytes and seconds per weight version, full model vs a LoRA adapter, side by side.

Command (from the repository root; about 3 minutes on 2 cores for hf, plus ~2 minutes per model for vLLM):

    python bench/lora_push.py [--models tiny,100m] [--engines hf,vllm] [--rank 16] [--versions 5]

For each model (`tiny`: fleetrl.tiny_model's default, ~0.1M parameters; `100m`: a Qwen2 of ~100M parameters,
hidden 768, 16 layers, built the same way, no download) it pushes `--versions` versions of each kind,
interleaved (full, LoRA, full, LoRA, ...), through a real WeightPublisher (loopback TCP) into a started engine:

- ``full``: the whole float32 state dict, loaded in place (the engine's full-weight path);
- ``lora``: a PEFT adapter of rank `--rank` on every linear layer of the decoder (`target_modules="all-linear"`,
  what the trainer publishes with ``Config.lora_rank``): ``get_peft_model_state_dict``, float32.

Per version it reports the manifest's bytes, ``publish_s`` (the trainer's side: snapshot + checksums),
``load_s`` (``engine.load_weights``: fetch + verify + check + apply; for LoRA on hf the merge, on vLLM the
adapter folder + ``add_lora``), of which ``pause_s`` stopped generation, and their sum (medians). The hf
engine gets one engine per kind (a full load resets the base copies LoRA keeps); the vLLM engine is one
LoRA-enabled engine serving both kinds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    # ~101.5M parameters: per layer 2*768^2 (q, o) + 2*768*256 (k, v) + 3*768*2048 (mlp) = 6.29M, x 16 layers.
    "100m": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}


def make_adapter(model_dir: str, rank: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """A rank-`rank` all-linear PEFT adapter with random lora_B: (tensors, adapter config, base parameters)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
    return state, config, params


async def start_engine(name: str, model_dir: str, rank: int) -> Any:
    if name == "vllm":
        from fleetrl.services.inference.vllm_engine import VLLMEngine

        engine: Any = VLLMEngine(model_dir, max_model_len=256, max_lora_rank=rank)
    else:
        from fleetrl.services.inference.hf_engine import HFEngine

        engine = HFEngine(model_dir, max_lora_rank=rank)
    await engine.start()
    return engine


async def bench_model(model: str, engine_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from safetensors.torch import load_file

    from fleetrl.services.inference.engine import SamplingRequest
    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.weights import WeightPublisher

    tmp = tempfile.TemporaryDirectory(prefix="fleetrl-lora-bench-")
    model_dir = str(build_tiny_model(Path(tmp.name) / model, **MODELS[model]))
    full_state = load_file(f"{model_dir}/model.safetensors")
    adapter_state, adapter_config, params = make_adapter(model_dir, args.rank)
    kinds = {"full": (full_state, None), "lora": (adapter_state, adapter_config)}
    if engine_name == "vllm":
        shared = await start_engine(engine_name, model_dir, args.rank)
        engines = {"full": shared, "lora": shared}
    else:
        engines = {kind: await start_engine(engine_name, model_dir, args.rank) for kind in kinds}
    rows: list[dict[str, Any]] = []
    publisher = WeightPublisher(keep_versions=1)
    try:
        version = 0
        for _ in range(args.versions):
            for kind, (state, config) in kinds.items():
                engine = engines[kind]
                version = max(version, engine.loaded_version) + 1
                t0 = time.perf_counter()
                manifest = await asyncio.to_thread(publisher.publish, version, state, adapter=config)
                t1 = time.perf_counter()
                result = await engine.load_weights(version, publisher.address, timeout_s=300.0)
                t2 = time.perf_counter()
                assert result.checksum == manifest.checksum
                # One short request on the new version, so a lazily applied adapter (vLLM) is really in use.
                (c,) = await engine.generate(SamplingRequest([5, 6, 7], max_tokens=4, seed=version))
                assert c.versions == [version] * len(c.token_ids)
                rows.append(
                    {
                        "model": model,
                        "params": params,
                        "engine": engine_name,
                        "kind": kind,
                        "bytes": manifest.total_bytes,
                        "publish_s": t1 - t0,
                        "load_s": t2 - t1,
                        "pause_s": result.pause_s,
                        "total_s": t2 - t0,
                    }
                )
    finally:
        publisher.close()
        for engine in {id(e): e for e in engines.values()}.values():
            await engine.shutdown()
        tmp.cleanup()
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(r["model"], r["engine"]) for r in rows}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    for model, engine in keys:
        mine = [r for r in rows if r["model"] == model and r["engine"] == engine]
        full_bytes = statistics.median(r["bytes"] for r in mine if r["kind"] == "full")
        for kind in ("full", "lora"):
            rs = [r for r in mine if r["kind"] == kind]
            out.append(
                {
                    "model": model,
                    "params_m": rs[0]["params"] / 1e6,
                    "engine": engine,
                    "kind": kind,
                    "mb": rs[0]["bytes"] / 1e6,
                    "pct_of_full": 100.0 * rs[0]["bytes"] / full_bytes,
                    **{k: statistics.median(r[k] for r in rs) for k in ("publish_s", "load_s", "pause_s", "total_s")},
                    "versions": len(rs),
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,100m", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--engines", default="hf", help="comma-separated: hf, vllm")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--versions", type=int, default=5, help="versions of each kind (interleaved)")
    parser.add_argument("--json", action="store_true", help="print every version's row as JSON")
    args = parser.parse_args()
    import torch

    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for engine in args.engines.split(","):
            rows += asyncio.run(bench_model(model, engine, args))
    if args.json:
        print(json.dumps(rows, indent=2))
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; LoRA rank {args.rank}")
    print("| model | params | engine | push | MB | % of full | publish_s | load_s (of which pause_s) | total_s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summarise(rows):
        print(
            f"| {s['model']} | {s['params_m']:.1f}M | {s['engine']} | {s['kind']} | {s['mb']:.2f} | "
            f"{s['pct_of_full']:.1f} % | {s['publish_s']:.3f} | {s['load_s']:.3f} ({s['pause_s']:.3f}) | "
            f"{s['total_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
