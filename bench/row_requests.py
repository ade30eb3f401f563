"""One step's completions as separate n = 1 requests vs one request per row, through the hf replica's gRPC server
and on the engine alone (issue 19: what the sampler's merging of a row's calls saves).

Command (from the repository root; about 20 s):

    python bench/row_requests.py [--model DIR] [--rows 16] [--group 8] [--max-tokens 5] [--rounds 6]

One process, one torch thread, one hf engine serving a gRPC server on loopback, and an InferenceClient in the same
process (so the client's costs count too). Arms, alternating each round: `grpc_n1` (rows x group seeded n = 1
Generate calls at once, what the gateway sent before merging), `grpc_rows` (one call per row with a seed per
completion, what it sends now), `engine_n1` (the n = 1 requests straight to the engine, no gRPC). The prompts are
"count i to i + 3:" tokenized by the model's tokenizer. Reported: mean wall and process CPU seconds per step of
the middle rounds (fastest and slowest dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
from pathlib import Path


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    from transformers import AutoTokenizer

    from fleetrl.clients.inference import InferenceClient
    from fleetrl.services.inference.config import InferenceConfig
    from fleetrl.services.inference.engine import SamplingRequest
    from fleetrl.services.inference.server import create_server, make_engine

    model = args.model
    if model is None:
        from fleetrl.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="fleetrl-row-requests-")) / "model"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(f"count {i} to {i + 3}:") for i in range(args.rows)]
    config = InferenceConfig(model=model, engine="hf", grpc_port=0, http_port=None, metrics_port=None, max_num_seqs=256)
    engine = make_engine(config)
    service = create_server(config, engine)
    await service.start()
    client = InferenceClient(f"127.0.0.1:{service.grpc_port}")
    g, tokens = args.group, args.max_tokens

    def n1(i: int, j: int) -> SamplingRequest:
        return SamplingRequest(prompts[i], n=1, max_tokens=tokens, seed=1000 * i + j)

    def row(i: int) -> SamplingRequest:
        return SamplingRequest(prompts[i], n=g, max_tokens=tokens, seeds=tuple(1000 * i + j for j in range(g)))

    arms = {
        "grpc_n1": lambda: asyncio.gather(*(client.generate(n1(i, j)) for i in range(args.rows) for j in range(g))),
        "grpc_rows": lambda: asyncio.gather(*(client.generate(row(i)) for i in range(args.rows))),
        "engine_n1": lambda: asyncio.gather(*(engine.generate(n1(i, j)) for i in range(args.rows) for j in range(g))),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for arm in arms.values():  # warm-up
            await arm()
        for _ in range(args.rounds):
            for name, arm in arms.items():
                c, t = cpu_s(), time.perf_counter()
                await arm()
                times[name].append((time.perf_counter() - t, cpu_s() - c))
    finally:
        await client.close()
        await service.stop()
    out = {}
    for name, samples in times.items():
        kept = sorted(samples)[1:-1] if len(samples) > 2 else samples
        out[name] = (sum(w for w, _ in kept) / len(kept), sum(c for _, c in kept) / len(kept))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the tiny Qwen2)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    result = asyncio.run(run(args))
    print(f"{args.rows} rows x {args.group} completions, {args.max_tokens} tokens, mean of the middle rounds")
    print("| arm | wall s per step | CPU s per step |")
    print("| --- | --- | --- |")
    for name, (wall, cpu) in result.items():
        print(f"| {name} | {wall:.4f} | {cpu:.4f} |")


if __name__ == "__main__":
    main()
