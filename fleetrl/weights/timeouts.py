"""How long a weight transfer may take: a floor plus its bytes at a conservative rate (pure logic).

A fixed timeout sized for small models (300 s) fails an 8B model (16 GB in bfloat16) on a slow link and is far too
long for a tiny one, so the bound on a whole push or load scales with the bytes moved:

    budget_s = floor_s + nbytes / MIN_TRANSFER_RATE_BYTES_PER_S

`floor_s` is the configured timeout (`weight_load_timeout_s`, a LoadWeights request's `timeout_s`, a fetch's
`timeout_s`): what a transfer of no bytes may take (connecting, the manifest, the swap). The rate, 100 MB/s (0.8
Gbit/s), is below what one loaded host moves over the weight stream (loopback fetches here run at several hundred
MB/s; docs/benchmarks.md) and below a 1 Gbit/s link, so a healthy transfer never hits the bound: 16 GB gets
300 + 160 s, 140 GB (70B in bfloat16) 300 + 1400 s. Waits for the next reply keep their own, fixed bound
(`timeout_s`): a stalled peer still fails fast.
"""

from __future__ import annotations

MIN_TRANSFER_RATE_BYTES_PER_S = 100e6


def transfer_timeout_s(floor_s: float, nbytes: int, rate_bytes_per_s: float = MIN_TRANSFER_RATE_BYTES_PER_S) -> float:
    """The time a transfer of `nbytes` may take: `floor_s` plus the bytes at `rate_bytes_per_s`."""
    if not floor_s > 0:
        raise ValueError(f"floor_s must be positive, got {floor_s!r}")
    if not rate_bytes_per_s > 0:
        raise ValueError(f"rate_bytes_per_s must be positive, got {rate_bytes_per_s!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return floor_s + nbytes / rate_bytes_per_s


def push_deadline_s(floor_s: float, nbytes: int, rate_bytes_per_s: float = MIN_TRANSFER_RATE_BYTES_PER_S) -> float:
    """The controller's bound on one replica's load of `nbytes` (its LoadWeights deadline): `floor_s` plus the bytes
    three times at `rate_bytes_per_s`, since a load may move them three times, each bounded by the replica at that
    rate: a collective attempt, the ZeroMQ fetch it falls back to, and the copy into the model."""
    return transfer_timeout_s(floor_s, 3 * nbytes, rate_bytes_per_s)
