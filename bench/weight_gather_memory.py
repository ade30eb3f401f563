"""Rank 0's host memory for one published version at world size 2: today's full gather vs the per-tensor gather.

Command (from the repository root; about a minute on 2 cores, building the model first):

    python bench/weight_gather_memory.py [--size 100M] [--dtype bfloat16] [--modes full,sharded,trainer] \
        [--models-dir /tmp/fleetrl-rs]

Two gloo ranks on CPU load the model (float32), shard it with FSDP2 (`shard_model`), and rank 0 publishes one
version the way named by the mode, each mode in fresh processes:

- ``full``: today's path: ``full_state_dict`` (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``:
  the whole model in float32 in rank 0's memory), then ``publish(..., background=True, float_dtype=...)``;
- ``sharded``: ``publish(model.state_dict(), sharded=True, float_dtype=...)`` on rank 0 and ``gather_shards`` on
  rank 1 (``HostStaging.gather``: one tensor at a time, cast before it is copied to the host).

- ``trainer``: the path every step takes now: a ``PolicyTrainer`` at world size 2 (inference_dtype = the served
  dtype) whose weight sink is ``WeightPublisher.publish(background=True)`` as the trainer service wires it;
  rank 0 calls ``trainer.publish()`` (``_do_publish``: ``publish(sharded=True)``) while rank 1 runs ``follow()``
  (``gather_shards``). Rank 1's peak is measured over its whole ``follow()``.

It prints, per rank, the peak resident memory during the publish (``VmHWM``, reset just before it through
``/proc/self/clear_refs``) above the resident memory just before it, next to the version's bytes in float32 and in
the served dtype (issue 39 item 2). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _rank(rank: int, port: int, model_dir: str, mode: str, dtype_name: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from fleetrl.trainer.distributed import DistContext, destroy, full_state_dict, shard_model
    from fleetrl.weights import WeightPublisher
    from fleetrl.weights.publisher import gather_shards

    ctx = DistContext.from_env(device="cpu", timeout_s=600)
    dtype = getattr(torch, dtype_name)
    if mode == "trainer":
        _trainer_rank(ctx, model_dir, dtype_name, out)
        return
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, torch.device("cpu"), 2)
    import gc

    gc.collect()
    state_bytes = [(t.numel(), t.is_floating_point()) for t in model.state_dict().values()]
    publisher = WeightPublisher() if rank == 0 else None
    rss_before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM = VmRSS from here
    if mode == "full":
        state = full_state_dict(model, ctx)
        if publisher is not None:
            publisher.publish(1, state, background=True, float_dtype=dtype).result(timeout=600)
        del state
    elif publisher is not None:
        publisher.publish(1, model.state_dict(), sharded=True, float_dtype=dtype).result(timeout=600)
    else:
        gather_shards(model.state_dict(), dtype)
    result = {
        "rank": rank,
        "peak_growth_mb": _status_mb("VmHWM") - rss_before,
        "float32_mb": sum(n * 4 for n, _ in state_bytes) / 2**20,
        "served_mb": sum(n * (dtype.itemsize if f else 4) for n, f in state_bytes) / 2**20,
    }
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps(result))
    if publisher is not None:
        publisher.close()
    destroy(ctx)


def _trainer_rank(ctx: object, model_dir: str, dtype_name: str, out: str) -> None:
    """Mode ``trainer``: the publish `PolicyTrainer` does at world size 2 (see the module docstring)."""
    import functools
    import gc

    from fleetrl import Config
    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer.distributed import destroy
    from fleetrl.weights import WeightPublisher

    cfg = Config(base_model=model_dir, log_path=str(Path(out, "run")), inference_dtype=dtype_name)
    publisher = WeightPublisher() if ctx.is_main else None  # type: ignore[attr-defined]
    sink = functools.partial(publisher.publish, background=True) if publisher is not None else None
    trainer = PolicyTrainer(cfg, dist_ctx=ctx, weight_sink=sink)  # type: ignore[arg-type]
    dtype = getattr(torch, dtype_name)
    state_bytes = [(t.numel(), t.is_floating_point()) for t in trainer.model.state_dict().values()]
    gc.collect()
    rss_before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if publisher is not None:
        trainer.publish()
        trainer.publish()  # the second call waits for the staged version's checksum (the Publish RPC's)
        peak = _status_mb("VmHWM") - rss_before
        trainer.stop_followers()
    else:
        trainer.follow()
        peak = _status_mb("VmHWM") - rss_before
    result = {
        "rank": ctx.rank,  # type: ignore[attr-defined]
        "peak_growth_mb": peak,
        "float32_mb": sum(n * 4 for n, _ in state_bytes) / 2**20,
        "served_mb": sum(n * (dtype.itemsize if f else 4) for n, f in state_bytes) / 2**20,
    }
    Path(out, f"trainer-{ctx.rank}.json").write_text(json.dumps(result))  # type: ignore[attr-defined]
    if publisher is not None:
        publisher.close()
    destroy(ctx)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    import replica_serves

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100M", choices=list(replica_serves.SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/fleetrl-rs"))
    parser.add_argument("--modes", default="full,sharded,trainer", help="among full, sharded, trainer; each run twice")
    args = parser.parse_args(argv)
    model_dir = replica_serves.build_model(args.models_dir, args.size)
    print("| mode | float32 (MiB) | served (MiB) | rank 0 peak above its start (MiB) | rank 1 (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as out:
        for mode in args.modes.split(",") * 2:
            mp.spawn(_rank, args=(_free_port(), str(model_dir), mode, args.dtype, out), nprocs=2, join=True)
            r0 = json.loads(Path(out, f"{mode}-0.json").read_text())
            r1 = json.loads(Path(out, f"{mode}-1.json").read_text())
            print(
                f"| {mode} | {r0['float32_mb']:.0f} | {r0['served_mb']:.0f} | {r0['peak_growth_mb']:.0f} "
                f"| {r1['peak_growth_mb']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
