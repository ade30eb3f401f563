"""The per-rank setup (and exit) the spawned multi-rank trainer tests share."""

from __future__ import annotations

import os
import sys

import torch

from fleetrl.trainer import DistContext


def rank_context(rank: int, world: int, port: int, timeout_s: float = 120) -> DistContext:
    """Join a `world`-rank CPU (gloo) process group on loopback `port` as `rank`, one torch thread."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    return DistContext.from_env(device="cpu", timeout_s=timeout_s)


def end_rank() -> None:
    """Leave a rank that finished (its results written, its process group destroyed) the way the trainer
    service's ranks leave (fleetrl.commands.fast_exit): without the interpreter's teardown, when no thread or
    child is left to lose. Spawned ranks that went through that teardown aborted now and then in CI
    ("terminate called without an active exception", never reproduced here); the service never runs it.

    Called from a `finally` while an exception propagates, it returns instead, so the exception reaches
    `torch.multiprocessing.spawn`, which fails the spawning test with the rank's traceback (exiting 0 there
    hid the error: the test failed only later, on a missing results file)."""
    from fleetrl.commands.fast_exit import can_exit_fast, exit_fast

    if sys.exc_info()[1] is not None:
        return None
    if can_exit_fast():
        exit_fast(0)
    return None
