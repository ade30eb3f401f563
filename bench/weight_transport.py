"""Weight transport benchmark: the collective transport (gloo broadcast) vs the ZeroMQ weight stream, same bytes.

Command (from the repository root; about 2 minutes on 2 cores):

    python bench/weight_transport.py [--sizes-mb 100,500] [--receivers 1,2] [--repeats 3] [--bucket-mib 64]

The trainer's ``WeightPublisher`` runs in this process, each replica in its own process (as inference servers
do). For every size and receiver count it publishes a fresh version per trial and times, interleaved (the order
alternates between repeats):

- ``zmq``: ``fetch_weights`` in every receiver at once (what ``weight_transport = "zmq"`` does);
- ``collective``: ``fetch_collective`` in every receiver at once (ask the stream for the group, claim a rank, build
  the gloo group, receive the buckets, per-tensor xxh3 checks): what ``weight_transport = "collective"`` does;
- both again with ``verify`` off (``zmq raw`` / ``collective raw``): the transport alone.

Time is from the moment every receiver is told to start to the last one's return. GB/s is the bytes delivered to
all receivers over that time. Loopback on one host, so it measures CPU and memory costs of each path, not a
network: docs/benchmarks.md projects link-bound times from link rates.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fleetrl.weights import WeightPublisher, fetch_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_push import transformer_state_dict

TIMEOUT_S = 300.0
MODES = ("zmq", "collective", "zmq raw", "collective raw")


def _worker(tasks: Any, results: Any) -> None:
    """A replica process: loads versions as told until it gets None."""
    from fleetrl.weights.collective import fetch_collective, join_group, receive_state_dict, request_group

    while (task := tasks.get()) is not None:
        mode, address, version, replicas = task
        verify = not mode.endswith("raw")
        if mode.startswith("zmq"):
            manifest, tensors = fetch_weights(address, version, timeout_s=TIMEOUT_S, verify=verify)
        elif verify:
            received = fetch_collective(address, version, replicas=replicas, timeout_s=TIMEOUT_S)
            assert received is not None, "a bench receiver came after its group closed"
            manifest, tensors = received
        else:
            offer = request_group(address, version, replicas=replicas, timeout_s=TIMEOUT_S)
            membership = join_group(offer, 1)
            assert membership is not None
            manifest, tensors = offer.manifest, receive_state_dict(offer, membership, verify=False)
        received_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert received_bytes == manifest.total_bytes
        results.put((time.monotonic(), received_bytes))
        del tensors


def _trial(workers: list[Any], results: Any, mode: str, address: str, version: int) -> tuple[float, int]:
    started = time.monotonic()
    for tasks in workers:
        tasks.put((mode, address, version, len(workers)))
    reports = [results.get(timeout=TIMEOUT_S) for _ in workers]
    return max(r[0] for r in reports) - started, sum(r[1] for r in reports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="100,500")
    parser.add_argument("--receivers", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = set(modes) - set(MODES)
    if unknown:
        sys.exit(f"--modes: unknown {sorted(unknown)}; known {MODES}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch gloo over loopback")
    ctx = mp.get_context("spawn")
    for size_mb in [int(s) for s in args.sizes_mb.split(",")]:
        state = transformer_state_dict(size_mb * 10**6)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        for receivers in [int(r) for r in args.receivers.split(",")]:
            results = ctx.Queue()
            workers = [ctx.Queue() for _ in range(receivers)]
            procs = [ctx.Process(target=_worker, args=(q, results), daemon=True) for q in workers]
            for p in procs:
                p.start()
            times: dict[str, list[float]] = {m: [] for m in modes}
            version = 0
            with WeightPublisher(collective_bucket_bytes=args.bucket_mib << 20, keep_versions=1) as publisher:
                for repeat in range(args.repeats + 1):  # the first round warms up (imports, page faults)
                    order = modes if repeat % 2 == 0 else list(reversed(modes))
                    for mode in order:
                        version += 1
                        publisher.publish(version, state)
                        seconds, delivered = _trial(workers, results, mode, publisher.address, version)
                        assert delivered == receivers * nbytes
                        if repeat:
                            times[mode].append(seconds)
            for q in workers:
                q.put(None)
            for p in procs:
                p.join(30)
            for mode in modes:
                median = statistics.median(times[mode])
                runs = ", ".join(f"{t:.3f}" for t in times[mode])
                print(
                    f"{nbytes / 1e6:7.0f} MB x {receivers} receivers  {mode:15s} median {median:7.3f} s  "
                    f"{receivers * nbytes / median / 1e9:6.2f} GB/s  (runs: {runs})"
                )


if __name__ == "__main__":
    main()
