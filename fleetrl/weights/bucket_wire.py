"""The bucketed broadcast both ends of an engine transfer agree on (pure torch, no process group here).

A version travels as packed buckets: the tensors in order, each bucket at most `bucket_bytes` (a larger tensor
alone), every tensor's bytes starting on a 64-byte boundary. Both ends cut the buckets from the same metadata
(`plan_buckets`), so only names, dtypes and shapes cross the control plane; the receiver allocates one bucket at a
time and hands its tensors to the model's ``load_weights`` before the next arrives: no receiver holds the whole
version.

Verification without reading the weights back to the host: after each bucket the sender broadcasts the bucket's
`bucket_digest`, computed on the device where the bytes are; the receiver computes the digest of what it received
on its own device and compares the two values. Only the digest crosses to the host (one scalar per bucket, not the
bucket). It is a position-weighted sum of the bucket's 32-bit words modulo the prime 2**31 - 1: a change of one word
changes it (unless the word moves by a multiple of 2**31 - 1), and so does swapping two different words. It is a
transfer check, not a cryptographic one (the stream's xxh3 is neither).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleetrl.weights.gather import TensorMeta

__all__ = ["Bucket", "bucket_digest", "pack_bucket", "plan_buckets", "unpack_bucket"]

_ALIGN = 64
_MODULUS = (1 << 31) - 1  # a prime


@dataclass(frozen=True)
class Bucket:
    """Which tensors (indices into the metadata) a bucket holds, each one's byte offset, and its size."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """The buckets of `metas`, in order: a new one when the next tensor would overflow `bucket_bytes`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    buckets: list[Bucket] = []
    indices: list[int] = []
    offsets: list[int] = []
    end = 0
    for i, meta in enumerate(metas):
        start = -(-end // _ALIGN) * _ALIGN
        if indices and start + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(indices), tuple(offsets), end))
            indices, offsets, start = [], [], 0
        indices.append(i)
        offsets.append(start)
        end = start + meta.nbytes
    if indices:
        buckets.append(Bucket(tuple(indices), tuple(offsets), end))
    return buckets


def pack_bucket(bucket: Bucket, tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The bucket's bytes on `device` (uint8, `bucket.nbytes` long; the alignment gaps zero)."""
    packed = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
    for tensor, offset in zip(tensors, bucket.offsets, strict=True):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        packed[offset : offset + flat.numel()].copy_(flat)
    return packed


def unpack_bucket(bucket: Bucket, metas: Sequence[TensorMeta], packed: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view of `packed`) of each tensor in the bucket."""
    out = []
    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
        meta = metas[index]
        view = packed[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape)
        out.append((meta.name, view))
    return out


def bucket_digest(packed: torch.Tensor) -> torch.Tensor:
    """A one-element int64 tensor on `packed`'s device: the sum over the bucket's 32-bit words w_i of
    (w_i * (i + 1)) modulo the prime 2**31 - 1 (words zero-padded to a multiple of 4 bytes). Computed 2**20 words
    at a time, so the int64 temporaries stay at 8 MiB whatever the bucket's size; every factor is reduced below
    2**31 first, so each product fits in int64 and a slice's reduced products sum without overflow."""
    pad = (-packed.numel()) % 4
    data = packed if pad == 0 else torch.cat([packed, packed.new_zeros(pad)])
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=packed.device)
    step = 1 << 20
    for start in range(0, words.numel(), step):
        piece = (words[start : start + step].to(torch.int64) & 0xFFFFFFFF) % _MODULUS
        weights = torch.arange(start + 1, start + 1 + piece.numel(), dtype=torch.int64, device=packed.device)
        total = (total + ((piece * (weights % _MODULUS)) % _MODULUS).sum()) % _MODULUS
    return total.reshape(1)
