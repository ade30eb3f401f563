"""The pure part of the collective weight transport: who joins a push's group with which ranks, and the buckets.

``weight_transport = "collective"`` (docs/inference.md, "The weight path") moves a version by broadcasting it from the
trainer (rank 0) to every receiving worker of the replicas in one ``torch.distributed`` group per push
(``fleetrl.weights.collective`` is the transport). Nothing here imports torch or a socket.

**Membership.** A group is opened per version when the first replica asks for it; replicas join as they come, each
claiming a range of ranks (one per receiving worker) with one atomic ``add`` on the rendezvous store's rank counter.
The trainer closes the group when the replicas it expects have joined or the join window ends, by adding
``CLOSED`` to that counter: the value it gets back says how many ranks were claimed before the close (the world
size), and any claim after the close gets a value past ``CLOSED`` back, so that replica knows at once it is not a
member and loads the version over ZeroMQ instead. No rank is ever handed out twice and nobody waits for a replica
that never came.

**Buckets.** The version's tensors (the manifest's order) are packed into buckets of at most ``bucket_bytes``,
each tensor at an aligned offset; a tensor bigger than a bucket is split over several. Sender and receivers compute
the same layout from the manifest, so only the bytes cross the group. Within a bucket, ``plan_ops`` sends each large
piece on its own (from the trainer's snapshot, no copy) and packs only runs of small ones.

**Backend.** ``collective_backend`` (``COLLECTIVE_BACKENDS``) is resolved per push by ``choose_backend`` from the
device each side uses: "auto" is NCCL when the trainer and the replica both run on CUDA, else gloo; "nccl" refuses a
side off CUDA (that replica loads over ZeroMQ). ``receive_device`` is where a receiver's buffers live: its own device
under NCCL, host memory under gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CLOSED",
    "COLLECTIVE_BACKENDS",
    "DEFAULT_BUCKET_BYTES",
    "JOIN_TIMEOUT_S",
    "WEIGHT_TRANSPORTS",
    "Bucket",
    "Piece",
    "choose_backend",
    "claimed_rank_offset",
    "device_type",
    "flat_layout",
    "plan_buckets",
    "plan_ops",
    "receive_device",
    "world_size_at_close",
]

WEIGHT_TRANSPORTS = ("zmq", "collective")
COLLECTIVE_BACKENDS = ("auto", "gloo", "nccl")
DEVICE_TYPES = ("cpu", "cuda")
DEFAULT_BUCKET_BYTES = 64 << 20
JOIN_TIMEOUT_S = 10.0  # how long a group waits for the replicas it expects before it closes with those present
CLOSED = 1 << 40  # added to the rank counter to close a group; far above any number of ranks
_ALIGN = 64


def device_type(device: str) -> str:
    """The type of a torch device string ("cuda:1" -> "cuda"); ValueError for one the transport does not know."""
    kind = str(device).split(":", 1)[0].strip().lower()
    if kind not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {DEVICE_TYPES} (optionally with an index), got {device!r}")
    return kind


def choose_backend(setting: str, trainer_device: str, replica_device: str) -> str:
    """The backend of a push from the trainer on `trainer_device` to a replica on `replica_device` under
    ``collective_backend`` = `setting`: "auto" is "nccl" when both are CUDA, else "gloo"; "gloo" always; "nccl" only
    when both are CUDA (ValueError naming the setting otherwise: that replica loads over ZeroMQ)."""
    if setting not in COLLECTIVE_BACKENDS:
        raise ValueError(f"collective_backend must be one of {COLLECTIVE_BACKENDS}, got {setting!r}")
    both_cuda = device_type(trainer_device) == "cuda" and device_type(replica_device) == "cuda"
    if setting == "auto":
        return "nccl" if both_cuda else "gloo"
    if setting == "nccl" and not both_cuda:
        raise ValueError(
            f"collective_backend 'nccl' needs the trainer and the replica on CUDA (trainer on {trainer_device!r}, "
            f"replica on {replica_device!r}); set collective_backend 'auto' or 'gloo'"
        )
    return setting


def receive_device(backend: str, replica_device: str) -> str:
    """Where a receiver's buffers live: its own device under NCCL (which must then be CUDA), host memory under gloo."""
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        if device_type(replica_device) != "cuda":
            raise ValueError(f"an NCCL receiver needs a CUDA device, got {replica_device!r}")
        return replica_device
    raise ValueError(f"collective backend must be 'gloo' or 'nccl', got {backend!r}")


def claimed_rank_offset(counter_after_claim: int, ranks: int) -> int | None:
    """The first rank of a replica whose claim of `ranks` ranks returned `counter_after_claim` (the store's ``add``),
    or None when the group had closed before the claim (the replica is not a member). Rank 0 is the trainer."""
    if ranks < 1:
        raise ValueError(f"a replica claims at least one rank, got {ranks}")
    if counter_after_claim >= CLOSED:
        return None
    if counter_after_claim < ranks:
        raise ValueError(f"rank counter {counter_after_claim} is below the claim of {ranks}: not this group's counter")
    return 1 + counter_after_claim - ranks


def world_size_at_close(counter_after_close: int) -> int:
    """The group's world size (the trainer and every claimed rank) from the value the closing ``add`` returned."""
    claimed = counter_after_close - CLOSED
    if claimed < 0:
        raise ValueError(f"rank counter {counter_after_close} was not closed with CLOSED")
    if claimed >= CLOSED:
        raise ValueError("the group was closed twice")
    return 1 + claimed


@dataclass(frozen=True)
class Piece:
    """Bytes [start, stop) of tensor `tensor_index`, at `offset` in its bucket."""

    tensor_index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One broadcast: `nbytes` bytes holding `pieces`."""

    nbytes: int
    pieces: tuple[Piece, ...]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Pack tensors of `sizes` bytes (in order) into buckets of at most `bucket_bytes`, each piece 64-byte aligned
    in its bucket; a tensor that does not fit in the room left goes to the next bucket, split over whole buckets
    when it is bigger than one. Empty tensors take no piece."""
    if bucket_bytes < _ALIGN or bucket_bytes % _ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {_ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    used = 0

    def flush() -> None:
        nonlocal pieces, used
        if pieces:
            buckets.append(Bucket(used, tuple(pieces)))
        pieces, used = [], 0

    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"tensor {index} has a negative size {size}")
        start = 0
        while start < size:
            offset = -(-used // _ALIGN) * _ALIGN
            room = bucket_bytes - offset
            if room <= 0 or (room < size - start and offset > 0):  # start it in a fresh bucket rather than split
                flush()
                continue
            stop = min(size, start + room)
            pieces.append(Piece(index, start, stop, offset))
            used = offset + (stop - start)
            start = stop
    flush()
    return tuple(buckets)


def plan_ops(bucket: Bucket, small_bytes: int) -> tuple[tuple[int, int], ...]:
    """The broadcasts of one bucket, as byte ranges of it: each piece of at least `small_bytes` alone (the sender
    broadcasts it from where it lies, no copy), each run of consecutive smaller pieces together (packed once).
    Sender and receivers compute the same ranges, so each broadcast has the same size on every rank."""
    ops: list[tuple[int, int]] = []
    run: tuple[int, int] | None = None
    for piece in bucket.pieces:
        end = piece.offset + piece.stop - piece.start
        if piece.stop - piece.start >= small_bytes:
            if run is not None:
                ops.append(run)
                run = None
            ops.append((piece.offset, end))
        else:
            run = (piece.offset, end) if run is None else (run[0], end)
    if run is not None:
        ops.append(run)
    return tuple(ops)


def flat_layout(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Offsets of tensors of `sizes` bytes in one flat receive buffer (64-byte aligned), and its size."""
    offsets, size = [], 0
    for nbytes in sizes:
        offsets.append(size)
        size += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(offsets), size
