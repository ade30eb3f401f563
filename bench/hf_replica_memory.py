"""Resident memory of an hf replica across weight versions (a publisher in another process, as in a run).

    python bench/hf_replica_memory.py [--hidden 1024 --layers 12 --versions 5]

Builds a random Qwen2-shaped model (float32), starts an `HFEngine` on it, and loads `--versions` full versions
published by a child process; after each load it prints the engine process's resident memory (VmRSS) right after
the load returns (the engine idle) and after one more generate. Numbers in docs/benchmarks.md ("hf replica memory").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import tempfile
from pathlib import Path


def rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def publisher_proc(model_dir: str, q_in: mp.Queue, q_out: mp.Queue) -> None:
    from safetensors.torch import load_file

    from fleetrl.weights import WeightPublisher

    state = {}
    for f in Path(model_dir).glob("*.safetensors"):
        state.update(load_file(str(f)))
    publisher = WeightPublisher()
    q_out.put(publisher.address)
    while (version := q_in.get()) is not None:
        publisher.publish(version, {n: t + 0.001 * version for n, t in state.items()})
        q_out.put(version)
    publisher.close()


async def measure(model_dir: str, versions: int) -> None:
    from fleetrl.clients.inference_types import SamplingRequest
    from fleetrl.services.inference.hf_engine import HFEngine

    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=publisher_proc, args=(model_dir, q_in, q_out))
    child.start()
    address = q_out.get(timeout=300)
    engine = HFEngine(model_dir, max_num_seqs=8)
    await engine.start()
    try:
        nbytes = sum(t.numel() * t.element_size() for t in engine._state.values())
        await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4))
        print(f"model {nbytes / 1e9:.2f} GB (float32); resident after start and a generate: {rss_gb():.2f} GB")
        print("| version | resident right after the load (GB) | after a generate (GB) |")
        print("| --- | --- | --- |")
        for version in range(1, versions + 1):
            q_in.put(version)
            q_out.get(timeout=300)
            await engine.load_weights(version, address)
            idle = rss_gb()
            await engine.generate(SamplingRequest([1, 2, 3], n=1, max_tokens=4))
            print(f"| {version} | {idle:.2f} | {rss_gb():.2f} |", flush=True)
    finally:
        q_in.put(None)
        child.join(timeout=60)
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()
    from fleetrl.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=16,
            num_kv_heads=4,
            intermediate_size=4 * args.hidden,
        )
        asyncio.run(measure(str(model_dir), args.versions))


if __name__ == "__main__":
    main()
