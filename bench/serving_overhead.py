"""Serving overhead: generation tokens/s through the gRPC server vs the same engine called in-process.

    python bench/serving_overhead.py --engine hf [--model DIR | --size tiny|small] [--batch 16]
        [--max-tokens 64] [--rounds 5] [--json out.json]

One engine object serves both paths: in-process, `batch` concurrent `engine.generate` calls; through gRPC, the
same requests as concurrent `Generate` RPCs from an InferenceClient over loopback to a server wrapping that
engine (client and server share this process, so client-side costs count against the server: a conservative
number). Every request uses ignore_eos so both paths generate exactly batch * max_tokens tokens. Rounds
alternate between the paths (after one warm-up each) and the median round is reported. Goal: the server keeps
>= 90 % of in-process throughput.
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

SIZES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--model", help="HF model dir (default: build a tiny one, see --size)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM CPU KV cache")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


async def _timed(calls) -> tuple[int, float, float]:
    """(tokens, wall seconds, process CPU seconds) of running the calls concurrently."""
    start, cpu = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*calls)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(c.token_ids) for completions in results for c in completions), seconds, cpu_s


async def run(args: argparse.Namespace, model_dir: str) -> dict:
    import torch

    from fleetrl.clients.inference import InferenceClient
    from fleetrl.services.inference.config import InferenceConfig
    from fleetrl.services.inference.engine import SamplingRequest
    from fleetrl.services.inference.server import create_server, make_engine

    config = InferenceConfig(
        model=model_dir,
        engine=args.engine,
        grpc_port=0,
        http_port=None,
        metrics_port=None,
        max_num_seqs=max(args.batch, 1),
        kv_cache_gib=args.kv_cache_gib,
    )
    engine = make_engine(config)
    service = create_server(config, engine)
    await service.start()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size or 256
    requests = [
        SamplingRequest(
            torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
            max_tokens=args.max_tokens,
            ignore_eos=True,
            seed=i,
        )
        for i in range(args.batch)
    ]
    rates: dict[str, list[float]] = {"in_process": [], "grpc": []}
    cpu_ms_per_1k: dict[str, list[float]] = {"in_process": [], "grpc": []}
    try:
        async with InferenceClient(f"127.0.0.1:{service.grpc_port}") as client:
            paths = {
                "in_process": lambda: [engine.generate(r) for r in requests],
                "grpc": lambda: [client.generate(r) for r in requests],
            }
            for calls in paths.values():  # warm-up
                await _timed(calls())
            for _ in range(args.rounds):
                for name, calls in paths.items():
                    tokens, seconds, cpu_s = await _timed(calls())
                    assert tokens == args.batch * args.max_tokens, (name, tokens)
                    rates[name].append(tokens / seconds)
                    cpu_ms_per_1k[name].append(1e6 * cpu_s / tokens)
    finally:
        await service.stop()
    in_process, grpc_rate = (statistics.median(rates[k]) for k in ("in_process", "grpc"))
    return {
        "engine": args.engine,
        "model": model_dir,
        "size": None if args.model else args.size,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "in_process_tokens_per_s": round(in_process, 1),
        "grpc_tokens_per_s": round(grpc_rate, 1),
        "grpc_over_in_process": round(grpc_rate / in_process, 3),
        # CPU time of this process (engine + server + client) per 1000 tokens: robust to other load.
        "in_process_cpu_ms_per_1k_tokens": round(statistics.median(cpu_ms_per_1k["in_process"]), 1),
        "grpc_cpu_ms_per_1k_tokens": round(statistics.median(cpu_ms_per_1k["grpc"]), 1),
        "all_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from fleetrl.tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / args.size, **SIZES[args.size]))
        result = asyncio.run(run(args, model_dir))
    print(json.dumps(result, indent=2))
    print(
        f"| {result['engine']} | {result['size'] or result['model']} | {result['batch']} | "
        f"{result['max_tokens']} | {result['in_process_tokens_per_s']} | "
        f"{result['grpc_tokens_per_s']} | {result['grpc_over_in_process']:.1%} | "
        f"{result['in_process_cpu_ms_per_1k_tokens']} | {result['grpc_cpu_ms_per_1k_tokens']} |"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM's engine spawns processes: keep the guard
    sys.exit(main())
