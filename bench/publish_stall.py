"""The trainer's stall per weight version: a publish in the step (before) vs a background publish (after).

Command (from the repository root; about 2 minutes on 2 cores with the default sizes):

    python bench/publish_stall.py [--sizes-mb 400,2000] [--repeats 4] [--cast bf16|none]

For each float32 state dict size (shaped like a decoder-only LM; 400 MB ~ 100M parameters, 2000 MB ~ 500M), it
publishes versions alternately with the two paths of `WeightPublisher.publish` and reports medians:

- ``in the step`` (``background=False``, the path every step took before): a copy into fresh memory (with the
  cast to ``--cast`` fused in), the xxh3 checksums, then serving; the step waits for all of it.
- ``background`` (``background=True``, what the trainer service uses now): a copy into reused staging buffers; the
  cast, the checksums and serving run in the publisher's stager thread beside the next step.

``stall_s`` is what the step waits; ``servable_s`` how long until a fetch can start receiving bytes (the Future
done; for the synchronous path the same as the stall). The first background publish allocates the staging buffers
(reported apart as ``first_stall_s``); the rest reuse them. Each background version is waited for before the next
measurement, so the two never overlap.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from collections.abc import Sequence

import torch

from fleetrl.weights import WeightPublisher


def transformer_state_dict(target_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights shaped like a decoder-only LM (bench/weight_push.py's shapes), about ``target_bytes``."""
    if target_bytes >= 500e6:
        hidden, inter, kv, vocab = 2048, 5632, 256, 32000
    else:
        hidden, inter, kv, vocab = 768, 2048, 128, 8192
    layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    layer_bytes = 4 * sum(torch.Size(s).numel() for s in layer.values())
    embed_bytes = 4 * vocab * hidden
    layers = max(1, round((target_bytes - embed_bytes) / layer_bytes))
    gen = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.rand(vocab, hidden, generator=gen)}
    for i in range(layers):
        for name, shape in layer.items():
            sd[f"model.layers.{i}.{name}"] = torch.rand(shape, generator=gen)
    sd["model.norm.weight"] = torch.rand(hidden, generator=gen)
    return sd


def measure(size_mb: int, repeats: int, cast: torch.dtype | None) -> dict[str, float]:
    sd = transformer_state_dict(size_mb * 10**6)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    params = sum(t.numel() for t in sd.values())
    stalls: dict[str, list[float]] = {"step": [], "background": []}
    servable: list[float] = []
    first_stall = 0.0
    version = 0
    with WeightPublisher() as pub:
        for i in range(repeats + 1):  # the first round warms both paths (allocations); it is not counted
            for mode in ("step", "background") if i % 2 == 0 else ("background", "step"):
                version += 1
                gc.collect()
                started = time.perf_counter()
                out = pub.publish(version, sd, float_dtype=cast, background=mode == "background")
                stall = time.perf_counter() - started
                if mode == "background":
                    out.result(600)
                    ready = time.perf_counter() - started
                    if i == 0:
                        first_stall = stall
                    else:
                        servable.append(ready)
                if i > 0:
                    stalls[mode].append(stall)
    return {
        "params_M": params / 1e6,
        "bytes_GB": nbytes / 1e9,
        "step_stall_s": statistics.median(stalls["step"]),
        "background_stall_s": statistics.median(stalls["background"]),
        "background_servable_s": statistics.median(servable),
        "first_stall_s": first_stall,
        "stall_ratio": statistics.median(stalls["background"]) / statistics.median(stalls["step"]),
        "staging_GBps": nbytes / 1e9 / statistics.median(stalls["background"]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="400,2000", help="float32 state dict sizes in MB")
    parser.add_argument("--repeats", type=int, default=4, help="measured publishes per path and size")
    parser.add_argument("--cast", choices=["bf16", "none"], default="bf16", help="the dtype the replicas serve")
    args = parser.parse_args(argv)
    cast = torch.bfloat16 if args.cast == "bf16" else None
    print(f"# {platform.node()}, torch {torch.__version__}, {torch.get_num_threads()} threads, cast {args.cast}")
    columns = ["params", "bytes", "stall in the step (s)", "stall, background (s)", "servable, background (s)"]
    columns += ["first background stall (s)", "stall ratio", "staging GB/s"]
    print("| " + " | ".join(columns) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for size in (int(s) for s in args.sizes_mb.split(",")):
        r = measure(size, args.repeats, cast)
        print(
            f"| {r['params_M']:.0f}M | {r['bytes_GB']:.2f} GB | {r['step_stall_s']:.3f} "
            f"| {r['background_stall_s']:.3f} "
            f"| {r['background_servable_s']:.3f} | {r['first_stall_s']:.3f} | {r['stall_ratio']:.2f} "
            f"| {r['staging_GBps']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
