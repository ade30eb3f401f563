"""Weight push benchmark: the fleetrl weight stream vs plain ZeroMQ PUSH/PULL of the same bytes.

Command (from the repository root; about 1.5 minutes on 2 cores):

    python bench/weight_push.py [--sizes-mb 100,1000] [--receivers 1,2] [--repeats 5] [--chunk-mib N]

For each state dict size (float32, tensor shapes of a small decoder-only transformer) and each
receiver count, the publisher runs in this process and each receiver in its own process (as
inference servers do). It times, interleaved:

- ``fleetrl``: ``fetch_weights`` in every receiver at once (manifest, credit-flow chunk requests,
  zero-copy receive, per-tensor xxh3 checks), from the first receiver's call to the last return;
- ``zmq drop`` / ``zmq keep``: the same messages (same sizes, ``copy=False``) pushed by one PUSH
  socket per receiver to a PULL socket that drops each message (the wire's ceiling) or keeps them
  all until the end (what any receiver that holds the weights pays for fresh memory).

It prints median seconds, aggregate GB/s (bytes delivered to all receivers / seconds), the ratios,
median receiver CPU seconds, and the one-off ``publish`` cost (snapshot copy + checksums).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from fleetrl.weights import WeightPublisher, fetch_weights
from fleetrl.weights.manifest import plan_chunks, tensor_bytes

CHUNK_BYTES = 1 << 30  # WeightPublisher's default
TIMEOUT_S = 120.0


def transformer_state_dict(target_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights shaped like a small decoder-only LM, with about ``target_bytes`` in all."""
    if target_bytes >= 500e6:
        hidden, inter, kv, vocab = 2048, 5632, 256, 32000
    else:
        hidden, inter, kv, vocab = 768, 2048, 128, 8192
    layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.q_proj.bias": (hidden,),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.v_proj.bias": (kv,),
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


def _worker(tasks: Any, results: Any) -> None:
    """A receiver process: runs fetch or raw-pull tasks until it gets None."""
    import zmq

    while (task := tasks.get()) is not None:
        kind = task[0]
        if kind == "fetch":
            _, address, version = task
            cpu, started = _cpu_s(), time.monotonic()
            manifest, tensors = fetch_weights(address, version, timeout_s=TIMEOUT_S)
            finished = time.monotonic()
            received = sum(t.numel() * t.element_size() for t in tensors.values())
            assert received == manifest.total_bytes
            results.put((started, finished, received, _cpu_s() - cpu))
            del tensors
        else:  # raw PUSH/PULL baseline, dropping or keeping what it receives
            _, address, messages, keep = task
            sock = zmq.Context.instance().socket(zmq.PULL)
            sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
            sock.connect(address)
            results.put("connected")
            cpu, received, kept = _cpu_s(), 0, []
            for _ in range(messages):
                frame = sock.recv(copy=False)
                received += len(frame)
                if keep:
                    kept.append(frame)
            finished = time.monotonic()
            results.put((None, finished, received, _cpu_s() - cpu))
            del kept
            sock.close()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _time_fetch(workers: Sequence[Any], results: Any, address: str, version: int) -> tuple[float, float]:
    """Seconds from the first receiver's start to the last one's end, and mean receiver CPU s."""
    for tasks in workers:
        tasks.put(("fetch", address, version))
    reports = [results.get(timeout=TIMEOUT_S) for _ in workers]
    cpu = statistics.mean(r[3] for r in reports)
    return max(r[1] for r in reports) - min(r[0] for r in reports), cpu


def _time_raw(
    workers: Sequence[Any],
    results: Any,
    payloads: Sequence[memoryview],
    context: Any,
    keep: bool,
) -> tuple[float, float]:
    import zmq

    sockets = []
    for tasks in workers:
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # every chunk is a zero-copy reference; queue them all
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        sockets.append(sock)
        tasks.put(("raw", sock.getsockopt_string(zmq.LAST_ENDPOINT), len(payloads), keep))
    for _ in workers:
        assert results.get(timeout=TIMEOUT_S) == "connected"
    time.sleep(0.05)  # let the TCP connections finish their handshakes
    started = time.monotonic()
    for payload in payloads:
        for sock in sockets:
            sock.send(payload, copy=False)
    reports = [results.get(timeout=TIMEOUT_S) for _ in workers]
    finished = max(r[1] for r in reports)
    expected = sum(len(p) for p in payloads)
    assert all(r[2] == expected for r in reports)
    for sock in sockets:
        sock.close()
    return finished - started, statistics.mean(r[3] for r in reports)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="100,1000", help="state dict sizes in MB")
    parser.add_argument("--receivers", default="1,2", help="receiver counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES >> 20)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    receiver_counts = [int(s) for s in args.receivers.split(",")]
    chunk_bytes = args.chunk_mib << 20

    import zmq

    spawn = mp.get_context("spawn")  # receivers must not inherit this process's zmq threads
    results = spawn.Queue()
    queues = [spawn.Queue() for _ in range(max(receiver_counts))]
    procs = [spawn.Process(target=_worker, args=(q, results), daemon=True) for q in queues]
    for proc in procs:
        proc.start()
    context = zmq.Context()
    rows: list[dict[str, Any]] = []
    publish_times: dict[int, float] = {}
    try:
        for size_mb in sizes:
            sd = transformer_state_dict(size_mb * 1_000_000)
            with WeightPublisher(chunk_bytes=chunk_bytes) as pub:
                started = time.perf_counter()
                manifest = pub.publish(1, sd)
                publish_times[manifest.total_bytes] = time.perf_counter() - started
                views = [tensor_bytes(t) for t in sd.values()]
                chunks = plan_chunks(manifest, chunk_bytes)
                payloads = [views[c.tensor_index][c.start : c.stop] for c in chunks]
                _time_fetch(queues[:1], results, pub.address, 1)  # warm-up
                _time_raw(queues[:1], results, payloads, context, keep=True)
                for count in receiver_counts:
                    runs: dict[str, list[tuple[float, float]]] = {"drop": [], "keep": [], "fleetrl": []}
                    for _ in range(args.repeats):  # interleaved, so load changes hit all three
                        runs["drop"].append(_time_raw(queues[:count], results, payloads, context, False))
                        runs["keep"].append(_time_raw(queues[:count], results, payloads, context, True))
                        runs["fleetrl"].append(_time_fetch(queues[:count], results, pub.address, 1))
                    row: dict[str, Any] = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
                    row.update({f"{k}_cpu": statistics.median(c for _, c in v) for k, v in runs.items()})
                    row.update(nbytes=manifest.total_bytes, tensors=len(sd), chunks=len(chunks))
                    row.update(receivers=count)
                    rows.append(row)
                    _print_row(row)
            del sd, views, payloads
    finally:
        for q in queues:
            q.put(None)
        for proc in procs:
            proc.join(timeout=30)
        context.term()
    print()
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}, chunk {args.chunk_mib} MiB, torch {torch.__version__}, "
        f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), median of {args.repeats}"
    )
    print()
    print(
        "| state dict | receivers | zmq PUSH/PULL, drop: s (GB/s) | zmq PUSH/PULL, keep: s (GB/s) "
        "| fleetrl fetch_weights: s (GB/s) | fleetrl / drop | fleetrl / keep |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        moved = row["nbytes"] * row["receivers"]
        cells = [f"{row[k]:.3f} ({moved / row[k] / 1e9:.2f})" for k in ("drop", "keep", "fleetrl")]
        print(
            f"| {row['nbytes'] / 1e6:.0f} MB, {row['tensors']} tensors, {row['chunks']} chunks "
            f"| {row['receivers']} | {' | '.join(cells)} "
            f"| {row['drop'] / row['fleetrl']:.0%} | {row['keep'] / row['fleetrl']:.0%} |"
        )
    print()
    print("| state dict | receivers | receiver CPU s: zmq drop | zmq keep | fleetrl |")
    print("|---|---|---|---|---|")
    for row in rows:
        cpu = " | ".join(f"{row[k + '_cpu']:.2f}" for k in ("drop", "keep", "fleetrl"))
        print(f"| {row['nbytes'] / 1e6:.0f} MB | {row['receivers']} | {cpu} |")
    print()
    for nbytes, seconds in publish_times.items():
        print(f"publish (snapshot copy + checksums) of {nbytes / 1e6:.0f} MB: {seconds:.2f} s")


def _print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['nbytes'] / 1e6:7.0f} MB x{row['receivers']}: drop {row['drop']:.3f}s  "
        f"keep {row['keep']:.3f}s  fleetrl {row['fleetrl']:.3f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()
