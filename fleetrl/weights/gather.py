"""A sharded model's weights, gathered one tensor at a time and cast on their device (issue 39 item 2).

At world size > 1 each rank holds only its FSDP2 shards (DTensors). `ShardedWeights` turns the model's state dict
into what a weight path sends, without ever gathering the whole model: iterating it all-gathers one tensor
(`full_tensor()`, a collective every rank runs in the same order), casts it to the served dtype on its device and
yields it; the consumer copies it out (into reused host buckets for the ZeroMQ stream: `HostStaging.gather`; onto
the wire for a collective path) and drops it before the next one. `buckets(bucket_bytes)` batches the same stream
into device buckets of at most `bucket_bytes` (a tensor larger than that alone), which a collective path hands to
its broadcast as they are. `metadata()` gives every tensor's name, served dtype and full shape without gathering
anything (a DTensor's shape is the global one).

Its shape is that of vLLM's trainer-side `WeightSource` (``metadata()``, a fresh pass per ``iter()``, batches of
``(names, tensors)``), so a trainer engine can take it (fleetrl.weights.vllm_gloo). Pure torch: no socket here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = ["ShardedWeights", "TensorMeta", "gather_shards", "served_dtype"]


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as it travels: name, served dtype, full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def served_dtype(tensor: torch.Tensor, float_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` travels in: `float_dtype` for a floating tensor when given, else its own."""
    return float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype


class ShardedWeights:
    """The full tensors of a (possibly) sharded state dict, one at a time, cast to the served dtype on the device.

    Every rank holding shards must iterate it in lockstep (each DTensor's gather is a collective); plain tensors
    pass through (a world-size-1 model, or a buffer FSDP does not shard). `peak_full_bytes` records the most bytes
    of full tensors this object had alive at once (tests and benchmarks: one tensor for `__iter__`, one bucket for
    `buckets`), counting what it yielded until the consumer asked for the next.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], float_dtype: torch.dtype | None = None) -> None:
        self._items = list(state_dict.items())
        self.float_dtype = float_dtype
        self.peak_full_bytes = 0

    def metadata(self) -> list[TensorMeta]:
        """Name, served dtype and full shape of each tensor, in iteration order; gathers nothing."""
        return [TensorMeta(n, served_dtype(t, self.float_dtype), tuple(t.shape)) for n, t in self._items]

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metadata())

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._items:
            full = _full(tensor, self.float_dtype)
            self.peak_full_bytes = max(self.peak_full_bytes, _nbytes(full))
            yield name, full
            del full

    def buckets(self, bucket_bytes: int) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        """The same tensors batched: each batch at most `bucket_bytes` (a larger tensor alone), on the device."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        held = 0
        for name, tensor in self._items:
            size = _meta_bytes(tensor, self.float_dtype)
            if tensors and held + size > bucket_bytes:
                yield names, tensors
                names, tensors, held = [], [], 0
            full = _full(tensor, self.float_dtype)
            names.append(name)
            tensors.append(full)
            held += size
            self.peak_full_bytes = max(self.peak_full_bytes, held)
            del full
        if tensors:
            yield names, tensors


def gather_shards(state_dict: Mapping[str, torch.Tensor], float_dtype: torch.dtype | None = None) -> None:
    """A rank other than the publisher's in a sharded publish (``publish(..., sharded=True)`` on rank 0): takes part
    in each tensor's gather, in the same order, and keeps nothing."""
    for _, full in ShardedWeights(state_dict, float_dtype):
        del full


def _full(tensor: torch.Tensor, float_dtype: torch.dtype | None) -> torch.Tensor:
    full = tensor.detach()
    if hasattr(full, "full_tensor"):  # a DTensor shard: the all-gather, on every rank
        full = full.full_tensor()
    dtype = served_dtype(full, float_dtype)
    if full.dtype != dtype:
        full = full.to(dtype)  # on the device: a bfloat16 copy moves half the bytes afterwards
    return full


def _meta_bytes(tensor: torch.Tensor, float_dtype: torch.dtype | None) -> int:
    return tensor.numel() * served_dtype(tensor, float_dtype).itemsize


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
