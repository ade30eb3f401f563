"""Weight push in the dtype the replica serves: a float32 trainer's weights to a float32 replica vs the same
weights cast to bfloat16 for a bfloat16 replica (issue 17, `inference_dtype`).

Command (from the repository root):

    python bench/push_dtype.py [--engine hf|vllm] [--model-mb 0.5,400] [--pushes 5] [--json out.json]

For each model size it builds a local Qwen2-shaped model (fleetrl.tiny_model; ``--model-mb`` float32 MB, <= 1
means the default tiny model), starts two engines of it in this process, one serving float32 and one bfloat16,
and publishes versions of a perturbed float32 state dict on a real WeightPublisher (loopback TCP): as is for the
float32 engine, with ``float_dtype=bfloat16`` (the trainer's cast) for the other. Pushes alternate between the two
arms. Per push: the publish (snapshot copy, cast, checksums), the engine's ``load_weights`` end to end (fetch +
verify over TCP, then the in-place swap) and its pause, and the bytes that travelled. Medians over the pushes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swap_pause import model_shape

ARMS = ("float32", "bfloat16")


def make_engine(name: str, model_dir: str, dtype: str) -> Any:
    if name == "vllm":
        from fleetrl.services.inference.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, dtype=dtype, max_model_len=128, kv_cache_gib=1)
    from fleetrl.services.inference.hf_engine import HFEngine

    return HFEngine(model_dir, dtype=dtype)


async def one_size(engine_name: str, model_mb: float, pushes: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.weights import WeightPublisher

    tmp = tempfile.TemporaryDirectory(prefix="fleetrl-push-dtype-")
    model_dir = build_tiny_model(Path(tmp.name) / "model", **model_shape(model_mb))
    base = load_file(str(model_dir / "model.safetensors"))
    engines = {arm: make_engine(engine_name, str(model_dir), arm) for arm in ARMS}
    for engine in engines.values():
        await engine.start()
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    gen = torch.Generator().manual_seed(0)
    try:
        with WeightPublisher() as publisher:
            version = 0
            for _ in range(pushes):
                for arm in ARMS:
                    version += 1
                    state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
                    t0 = time.perf_counter()
                    cast = None if arm == "float32" else torch.bfloat16
                    manifest = publisher.publish(version, state, float_dtype=cast)
                    publish_s = time.perf_counter() - t0
                    engine = engines[arm]
                    # Each engine gets every version number it has not seen (the other arm's are skipped).
                    t1 = time.perf_counter()
                    result = await engine.load_weights(version, publisher.address, timeout_s=300)
                    load_s = time.perf_counter() - t1
                    rows[arm].append(
                        {
                            "publish_s": publish_s,
                            "load_s": load_s,
                            "transfer_s": result.transfer_s,
                            "pause_s": result.pause_s,
                            "mb": manifest.total_bytes / 1e6,
                        }
                    )
    finally:
        for engine in engines.values():
            await engine.shutdown()
        tmp.cleanup()
    params = sum(t.numel() for t in base.values())
    out: dict[str, Any] = {"model_mb_float32": sum(t.numel() * 4 for t in base.values()) / 1e6, "params": params}
    for arm in ARMS:
        out[arm] = {k: statistics.median(r[k] for r in rows[arm]) for k in rows[arm][0]}
    return out


def table(engine: str, results: list[dict[str, Any]]) -> str:
    lines = [
        "| engine | model (params) | served dtype | MB pushed | publish s | load s (fetch + verify + swap) | pause s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for arm in ARMS:
            r = res[arm]
            lines.append(
                f"| {engine} | {res['params'] / 1e6:.1f} M | {arm} | {r['mb']:.1f} | {r['publish_s']:.3f} | "
                f"{r['load_s']:.3f} | {r['pause_s']:.4f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model-mb", default="0.5,400", help="float32 model sizes in MB (<= 1: the tiny model)")
    parser.add_argument("--pushes", type=int, default=5, help="pushes per arm (alternating)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = [asyncio.run(one_size(args.engine, float(mb), args.pushes)) for mb in args.model_mb.split(",")]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.pushes} pushes per arm")
    print(table(args.engine, results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
