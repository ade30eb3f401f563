"""The time from a training step's end until every replica serves the new version: ZeroMQ direct vs collective.

Command (from the repository root; about 6 minutes on 2 cores with the default sizes, building the models first):

    python bench/replica_serves.py [--sizes 100M,500M,1B] [--repeats 3] [--replicas 2] [--models-dir /tmp/fleetrl-rs]

For each model size it builds (once, in ``--models-dir``) a random Qwen2-shaped model of about that many parameters
(``fleetrl.tiny_model.build_tiny_model`` with a 512-token vocabulary: nearly every parameter is in the layers), starts
``--replicas`` hf engines (``HFEngine``, bfloat16, one process each, as inference servers run) and publishes a new
bfloat16 version per trial from this process's ``WeightPublisher`` the way the trainer service does
(``publish(..., background=True)``: copy into the reused staging buffers, then checksums and serving beside the
next step). Then, as the controller does, it tells every replica to load the version at once:

- ``zmq``: ``load_weights`` over the weight stream (``weight_transport = "zmq"``, ``weight_fanout = "direct"``);
- ``collective``: ``load_weights(..., group_replicas=N)`` (``weight_transport = "collective"``; gloo, host memory).

``serves_s`` runs from the moment ``publish`` is called (the step's end) until the last replica's ``load_weights``
returned (its swap done: it serves the version); ``stall_s`` is what the step waited (``publish`` returning). The two
modes alternate within each repeat (the order flips every repeat); medians over ``--repeats``. Every load must report
the transport asked for (a collective load that fell back to ZeroMQ fails the run). Loopback on one host: this
measures the CPU and memory cost of each path on this machine, not a network.

``version_reaches_replica_s()`` is the one number issue 39 item 4 is about, for other benches to import: a new
float32 version of the 100M model (0.42 GB) published as the trainer service does, until one hf replica (float32)
serves it, over ZeroMQ; ``python bench/replica_serves.py --one-replica`` prints it (docs/benchmarks.md, "The CPU
weight path, before and after").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

TIMEOUT_S = 600.0
MODES = ("zmq", "collective")
# (hidden, layers, heads, kv heads, intermediate) of about 100M, 500M and 1B parameters with a 512-token vocabulary.
SHAPES = {
    "tiny": (64, 2, 2, 1, 128),  # dry runs (bench/guard.py --tiny)
    "100M": (768, 14, 12, 4, 2560),
    "113M": (768, 15, 12, 4, 2560),  # 0.45 GB in float32: bench/guard.py's version, bench/overlap.py's model
    "500M": (1536, 18, 12, 4, 5120),
    "1B": (2048, 20, 16, 4, 6656),
}


def build_model(models_dir: Path, size: str) -> Path:
    from fleetrl.tiny_model import build_tiny_model

    out = models_dir / size
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    hidden, layers, heads, kv_heads, inter = SHAPES[size]
    return build_tiny_model(
        out,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=512,
    )


def _replica(model_path: str, tasks: Any, results: Any, dtype: str = "bfloat16") -> None:
    """A replica process: an hf engine that loads versions as told until it gets None."""
    torch.set_num_threads(1)

    async def serve() -> None:
        from fleetrl.services.inference.hf_engine import HFEngine

        engine = HFEngine(model_path, dtype=dtype)
        await engine.start()
        results.put(("ready", 0.0, ""))
        while (task := await asyncio.to_thread(tasks.get)) is not None:
            mode, address, version, replicas = task
            group = replicas if mode == "collective" else 0
            result = await engine.load_weights(version, address, timeout_s=TIMEOUT_S, group_replicas=group)
            results.put(("loaded", time.monotonic(), result.transport))
        await engine.shutdown()

    asyncio.run(serve())


def measure(
    model_path: Path,
    replicas: int,
    repeats: int,
    dtype: str = "bfloat16",
    modes: tuple[str, ...] = MODES,
    warmup: int = 1,
) -> dict[str, Any]:
    """Medians over `repeats` of each mode (after `warmup` rounds); also every trial as `<mode>_serves_all`."""
    from fleetrl.weights import WeightPublisher

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(replicas)]
    procs = [ctx.Process(target=_replica, args=(str(model_path), q, results, dtype), daemon=True) for q in queues]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            assert results.get(timeout=TIMEOUT_S)[0] == "ready"
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        state = {k: v.detach() for k, v in model.state_dict().items()}  # the trainer's weights (no second copy)
        del model
        params = sum(t.numel() for t in state.values())
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        serves: dict[str, list[float]] = {m: [] for m in modes}
        stalls: dict[str, list[float]] = {m: [] for m in modes}
        version = 0
        with WeightPublisher(keep_versions=1) as publisher:
            for i in range(repeats + warmup):  # the first rounds warm both paths (staging buffers, first group)
                for mode in modes if i % 2 == 0 else modes[::-1]:
                    version += 1
                    with torch.no_grad():
                        next(iter(state.values())).add_(1.0)  # a new version's bytes
                    started = time.monotonic()
                    publisher.publish(version, state, background=True)
                    stall = time.monotonic() - started
                    for q in queues:
                        q.put((mode, publisher.address, version, replicas))
                    reports = [results.get(timeout=TIMEOUT_S) for _ in queues]
                    transports = {r[2] for r in reports}
                    assert transports == {mode}, f"{mode} push loaded by {transports}"
                    if i >= warmup:
                        serves[mode].append(max(r[1] for r in reports) - started)
                        stalls[mode].append(stall)
        return {
            "params_M": params / 1e6,
            "bytes_GB": nbytes / 1e9,
            **{f"{m}_serves_s": statistics.median(serves[m]) for m in modes},
            **{f"{m}_serves_all": serves[m] for m in modes},
            **{f"{m}_stall_s": statistics.median(stalls[m]) for m in modes},
        }
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def version_reaches_replica_s(
    repeats: int = 5, models_dir: Path = Path("/tmp/fleetrl-rs"), size: str = "100M", warmup: int = 2
) -> float:
    """Median seconds from a new float32 version's publish (``publish(background=True)``, the trainer service's
    way) until one float32 hf replica serves it over ZeroMQ: the 100M model is 0.42 GB. The first `warmup` versions
    are not counted (they allocate the publisher's and the replica's reused buffers)."""
    path = build_model(models_dir, size)
    return measure(path, 1, repeats, dtype="float32", modes=("zmq",), warmup=warmup)["zmq_serves_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100M,500M,1B", help=f"model sizes among {list(SHAPES)}")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/fleetrl-rs"))
    parser.add_argument(
        "--one-replica", action="store_true", help="print version_reaches_replica_s() (float32 100M, one replica)"
    )
    args = parser.parse_args(argv)
    if args.one_replica:
        path = build_model(args.models_dir, "100M")
        r = measure(path, 1, args.repeats, dtype="float32", modes=("zmq",), warmup=2)
        trials = " ".join(f"{s:.2f}" for s in r["zmq_serves_all"])
        print(f"| {r['params_M']:.0f}M | {r['bytes_GB']:.2f} GB float32 | {r['zmq_serves_s']:.3f} s | {trials} |")
        return
    print(f"# {platform.node()}, torch {torch.__version__}, {os.cpu_count()} CPUs, {args.replicas} hf replicas")
    print(
        "| model | bytes (bf16) | serves, zmq (s) | serves, collective (s) | stall, zmq (s) | stall, collective (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.sizes.split(","):
        path = build_model(args.models_dir, size)
        r = measure(path, args.replicas, args.repeats)
        print(
            f"| {r['params_M']:.0f}M | {r['bytes_GB']:.2f} GB | {r['zmq_serves_s']:.2f} "
            f"| {r['collective_serves_s']:.2f} "
            f"| {r['zmq_stall_s']:.3f} | {r['collective_stall_s']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
