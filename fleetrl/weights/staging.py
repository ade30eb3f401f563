"""`HostStaging`: a state dict snapshotted into reused, bucketed host buffers (pinned for a GPU source).

The trainer's step waits only for this copy, floating tensors cast to the served dtype on the way (a bfloat16 copy
writes half the bytes and runs a little faster than a float32 memcpy: 6.3 vs 5.6 GB/s of float32 source here); the
publisher hashes and serves the version from it beside the next step (``WeightPublisher.publish(background=True)``).
Copying into memory that was written before is about 3x faster than into fresh memory (5.6 vs 1.95 GB/s measured
on this machine: fresh pages are faulted in and zeroed on the first write), so the buffers are kept from one
version to the next: a few large buckets of ``bucket_bytes`` (a tensor larger than one gets a bucket of its own),
reallocated only when the tensors' sizes change. From a CUDA source the buckets are pinned, the cast runs on the
GPU and the copies are asynchronous on the current stream: the step returns once they are queued, and the reader
waits on the returned event first (``ready.synchronize()``); later kernels on that stream (the next step's
optimizer) run after the copies, so the copies read this version's values.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from fleetrl.weights.gather import ShardedWeights

BUCKET_BYTES = 256 << 20
_ALIGN = 64  # every tensor starts on a 64-byte boundary: any dtype view of its bytes is aligned


class HostStaging:
    """Reused host buffers for one snapshot at a time (the caller makes sure the previous one was consumed)."""

    def __init__(self, bucket_bytes: int = BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.allocations = 0  # how many times the buckets were (re)allocated
        self._buckets: list[torch.Tensor] = []
        self._key: tuple[Any, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the buckets hold."""
        return sum(b.numel() for b in self._buckets)

    def snapshot(
        self, tensors: Iterable[torch.Tensor], float_dtype: torch.dtype | None = None
    ) -> tuple[list[torch.Tensor], Any]:
        """Copy `tensors` into the buckets, floating ones cast to `float_dtype` on the way (on the GPU, before the
        copy, from a CUDA source; None: each keeps its dtype); return views of them (contiguous, in order) and a CUDA
        event to wait on before reading them (None: the copies are done)."""
        tensors = [t.detach() for t in tensors]
        dtypes = [float_dtype if float_dtype is not None and t.is_floating_point() else t.dtype for t in tensors]
        pinned = any(t.is_cuda for t in tensors)
        places, sizes = self._plan([t.numel() * d.itemsize for t, d in zip(tensors, dtypes, strict=True)])
        self._reserve(sizes, pinned)
        views = []
        for tensor, dtype, (bucket, offset, nbytes) in zip(tensors, dtypes, places, strict=True):
            view = self._buckets[bucket][offset : offset + nbytes].view(dtype).view(tensor.shape)
            if tensor.is_cuda and tensor.dtype != dtype:
                tensor = tensor.to(dtype)  # cast on the device: half the bytes cross PCIe for bfloat16
            view.copy_(tensor, non_blocking=pinned and tensor.is_cuda)
            views.append(view)
        ready = None
        if pinned:
            ready = torch.cuda.Event()
            ready.record()
        return views, ready

    def gather(
        self, tensors: Iterable[torch.Tensor], float_dtype: torch.dtype | None = None, *, keep: bool = True
    ) -> tuple[list[torch.Tensor], Any]:
        """`snapshot` for a sharded model (world size > 1): each tensor, a DTensor shard of an FSDP2 parameter or a
        plain tensor, is gathered alone (`full_tensor()`), cast on its device, copied into the buckets and dropped
        before the next one, so no rank holds more than one full tensor on its device and none gathers the whole
        model, let alone in float32 into pageable host memory (`get_model_state_dict(full_state_dict=True,
        cpu_offload=True)` did). Every rank calls it with its shards in the same order (the gathers are
        collectives); only the rank with `keep` (rank 0, which serves) holds buckets: the version's bytes in the
        served dtype, reused from one version to the next, pinned when the shards are on CUDA. Returns what
        `snapshot` does on that rank, ([], None) on the others."""
        tensors = list(tensors)
        source = ShardedWeights({str(i): t for i, t in enumerate(tensors)}, float_dtype)
        cuda = any(t.is_cuda for t in tensors)
        places, sizes = self._plan([meta.nbytes for meta in source.metadata()])
        if keep:
            self._reserve(sizes, pinned=cuda)
        views = []
        for (_, full), (bucket, offset, nbytes) in zip(source, places, strict=True):
            if keep:
                view = self._buckets[bucket][offset : offset + nbytes].view(full.dtype).view(full.shape)
                # Pinned: queued on the current stream; the allocator reuses `full`'s memory only after it.
                view.copy_(full, non_blocking=cuda and full.is_cuda)
                views.append(view)
            del full
        if not keep:
            return [], None
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        return views, ready

    def _reserve(self, sizes: list[int], pinned: bool) -> None:
        key = (tuple(sizes), pinned)
        if key != self._key:
            self._buckets = []  # released before the new ones are allocated
            self._buckets = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for size in sizes]
            self._key = key
            self.allocations += 1

    def _plan(self, nbytes: list[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
        """(bucket, offset, bytes) of each tensor and the size of each bucket: tensors in order, a new bucket when
        the next one would overflow the current (a tensor larger than a bucket alone in its own)."""
        places: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        for n in nbytes:
            start = -(-sizes[-1] // _ALIGN) * _ALIGN if sizes else 0
            if not sizes or (start + n > self.bucket_bytes and sizes[-1] > 0):
                sizes.append(0)
                start = 0
            places.append((len(sizes) - 1, start, n))
            sizes[-1] = start + n
        return places, sizes


class ServedBuffers:
    """Host memory the publisher serves versions from, reused once nothing refers to a version any more.

    The stager copies each staged version out of the staging buckets into memory it serves until the version is
    dropped (``keep_versions``). That memory used to be fresh for every version: a page fault per 4 KiB on the
    first write, 0.35 s per 0.42 GB on this VM against 0.02 s into memory written before (docs/benchmarks.md, "The
    CPU weight path, before and after"). Here a version's copy goes into a set of buffers whose previous version
    nothing refers to any more: not the publisher, not a fetch session, not a reply ZeroMQ is still sending (every
    payload memoryview holds its numpy array, watched by a weak reference), not a collective broadcast. With
    ``keep_versions`` 2 that is three sets, the memory the fresh copies held before.
    """

    def __init__(self) -> None:
        self.allocations = 0  # sets allocated (3 for keep_versions 2 while the tensors' sizes stay the same)
        self._sets: list[_BufferSet] = []

    @property
    def nbytes(self) -> int:
        return sum(s.memory.numel() for s in self._sets)

    def copy(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[memoryview]]:
        """Contiguous CPU copies of `tensors` in a free set, and the raw bytes of each (what the stream serves)."""
        offsets, end = [], 0
        for t in tensors:
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += t.numel() * t.element_size()
        self._sets = [s for s in self._sets if s.memory.numel() == end or not s.free()]  # other sizes: released
        target = next((s for s in self._sets if s.free()), None)
        if target is None:
            target = _BufferSet(torch.empty(end, dtype=torch.uint8))
            self._sets.append(target)
            self.allocations += 1
        copies, payloads, refs = [], [], []
        for tensor, offset in zip(tensors, offsets, strict=True):
            flat = target.memory[offset : offset + tensor.numel() * tensor.element_size()]
            copy = flat.view(tensor.dtype).view(tensor.shape)
            copy.copy_(tensor)
            array = flat.numpy()
            copies.append(copy)
            payloads.append(memoryview(array))
            refs += [weakref.ref(array), weakref.ref(copy)]
        target.refs = refs
        return copies, payloads


class _BufferSet:
    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.refs: list[weakref.ref] = []

    def free(self) -> bool:
        return all(r() is None for r in self.refs)
