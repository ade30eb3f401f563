"""A replica's peak host memory while it receives one version: through an engine group vs over the weight stream.

Command (from the repository root; about a minute on 2 cores):

    python bench/engine_receive_memory.py [--mb 400] [--bucket-mb 64]

A receiver process holds a "model" (float32 tensors shaped like a small LM's, `--mb` in all, allocated and
written before measuring) and receives one version of the same shapes into it, each way in fresh processes:

- ``engine``: through the "fleetrl_gloo" engine pair (fleetrl.weights.vllm_gloo): the trainer's
  `GlooTrainerWeightTransferEngine` broadcasts packed buckets of at most `--bucket-mb`; the receiver runs the
  worker engine's own receive loop (`receive_buckets`), copying each bucket's tensors into the model before the
  next bucket arrives (what vLLM's `load_weights` does);
- ``stream``: `fetch_weights(..., into=ReceiveBuffer())` from a `WeightPublisher` (the whole version lands in the
  receive buffer first), then the same copies into the model (the hf engine's and the staged vLLM load's shape).

It prints the receiver's peak resident memory during the receive (``VmHWM``, reset through ``/proc/self/clear_refs``
just before) above its resident memory before it (issue 39 item 3: no receiver holds a buffer of the whole
version). Linux only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _shapes(total_mb: int) -> dict[str, tuple[int, ...]]:
    """Float32 tensors like a small LM's: 16 layers of four 1024x1024-ish matrices, an embedding, norms."""
    hidden = 1024
    per_layer = 4 * hidden * hidden * 4
    embed_rows = 8192
    layers = max(1, (total_mb * 2**20 - embed_rows * hidden * 4) // per_layer)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (embed_rows, hidden)}
    for i in range(layers):
        for part in ("q", "k", "v", "o"):
            shapes[f"layers.{i}.{part}.weight"] = (hidden, hidden)
        shapes[f"layers.{i}.norm.weight"] = (hidden,)
    return shapes


def _model(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {name: torch.ones(shape) for name, shape in shapes.items()}  # written: its pages are resident


def _receiver(mode: str, shapes: dict[str, Any], conn: Any, out: str) -> None:
    torch.set_num_threads(1)
    model = _model(shapes)
    if mode == "engine":
        from fleetrl.weights.vllm_gloo import GlooInitInfo, GlooUpdateInfo, _join, receive_buckets

        _kind, payload = conn.recv()
        info = GlooInitInfo(**payload)
        group, _store = _join(info, info.rank_offset)
        conn.send("joined")
        _kind, payload = conn.recv()
        update = GlooUpdateInfo(**payload)
        rss_before = _status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                model[name].copy_(tensor)

        receive_buckets(group, info, update.metas(), load)
    else:
        from fleetrl.weights import fetch_weights
        from fleetrl.weights.fetch import ReceiveBuffer

        _kind, payload = conn.recv()
        rss_before = _status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        buffer = ReceiveBuffer()
        _, tensors = fetch_weights(payload["address"], payload["version"], into=buffer)
        for name, tensor in tensors.items():
            model[name].copy_(tensor)
    peak = _status_mb("VmHWM") - rss_before
    wrong = [n for n, t in model.items() if not bool((t == 2.0).all())]
    Path(out, f"{mode}.json").write_text(json.dumps({"peak_growth_mb": peak, "wrong": wrong}))
    conn.send("done")


class _PipeClient:
    """The trainer engine's ``VLLMWeightSyncClient`` for the receiver process (a pipe stands in for the rpcs)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.conn.send(("init", init_info))
        if not self.conn.poll(120) or self.conn.recv() != "joined":
            raise RuntimeError("the receiver did not join")

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: Any) -> None:
        self.conn.send(("update", {k: update_info[k] for k in ("names", "dtype_names", "shapes", "version")}))
        if not self.conn.poll(300) or self.conn.recv() != "done":
            raise RuntimeError("the receiver did not finish")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def _run(mode: str, shapes: dict[str, Any], bucket_bytes: int, out: str) -> dict[str, Any]:
    from fleetrl.weights import WeightPublisher
    from fleetrl.weights.gather import ShardedWeights
    from fleetrl.weights.vllm_gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=_receiver, args=(mode, shapes, child, out))
    process.start()
    version = {name: torch.full(shape, 2.0) for name, shape in shapes.items()}
    try:
        if mode == "engine":
            info = GlooTrainerInitInfo("127.0.0.1", 0, 2, bucket_bytes=bucket_bytes, timeout_s=120.0, rank=0)
            engine = GlooTrainerWeightTransferEngine.trainer_init(
                info, client=_PipeClient(conn), source=ShardedWeights(version)
            )
            engine.version = 1
            engine.send_weights()
            engine.shutdown()
        else:
            with WeightPublisher() as publisher:
                publisher.publish(1, version)
                conn.send(("fetch", {"address": publisher.address, "version": 1}))
                if not conn.poll(300) or conn.recv() != "done":
                    raise RuntimeError("the receiver did not finish")
    finally:
        process.join(60)
    return json.loads(Path(out, f"{mode}.json").read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=400, help="the version's size in MiB (float32)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="the engine's bucket size in MiB")
    args = parser.parse_args(argv)
    shapes = _shapes(args.mb)
    version_mb = sum(torch.Size(s).numel() * 4 for s in shapes.values()) / 2**20
    print("| way | version (MiB) | bucket (MiB) | receiver peak above its start (MiB) | all weights right |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as out:
        for mode in ("engine", "stream", "engine", "stream"):
            result = _run(mode, shapes, args.bucket_mb << 20, out)
            bucket = f"{args.bucket_mb}" if mode == "engine" else "-"
            print(
                f"| {mode} | {version_mb:.0f} | {bucket} | {result['peak_growth_mb']:.0f} | {not result['wrong']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
