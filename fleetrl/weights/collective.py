"""The collective weight transport: the trainer broadcasts a version into the replicas' workers over torch.distributed.

``weight_transport = "collective"`` (docs/inference.md, "Collective loads"). One process group per push, its
backend chosen per push from where the two sides run (``collective_backend``: "auto" is NCCL when the trainer and the
replica are both on CUDA, else gloo; ``collective_plan.choose_backend``), built from a ``TCPStore`` the trainer's
weight publisher opens for that push (no global ``init_process_group``: the trainer may run its own, and a replica's
workers run vLLM's):

1. A replica asks the trainer's weight stream for the group of a version (``request_group``: a ZeroMQ request on
   the stream it would otherwise fetch from, answered with the store's port, the group's name, the wire settings
   and the version's manifest). The first request opens the group: ``CollectiveSender`` starts on the trainer.
2. The replica claims one rank per receiving worker in the store (``join_group``: one atomic ``add``, see
   ``fleetrl.weights.collective_plan``) and waits for the group to close, which it does when the replicas the
   controller pushes to have joined or ``join_timeout_s`` has passed. A replica too late gets None and loads the
   version over ZeroMQ.
3. Every receiving worker builds the group with its rank (``receive_into``) and receives the buckets
   (``plan_buckets``) straight into its flat receive buffer, then checks each tensor's checksum against the manifest.

**Devices.** The replica's request names its device and the offer carries the backend and both sides' devices. Under
NCCL the trainer copies each bucket from its host snapshot into one reused buffer of the bucket size on its GPU and
broadcasts from there, and each receiver receives into a flat buffer on its own GPU (the tensors it loads are views of
it); under gloo both buffers are host memory (the sender broadcasts large pieces from the snapshot uncopied). The code
is the same for both: the device is a parameter, so the CPU tests drive the device path with gloo and "cpu".

Every wait is bounded: the join by ``join_timeout_s`` (plus the store's timeout), the group's rendezvous and each
broadcast by the push's ``timeout_s`` plus its bytes at a conservative rate (``fleetrl.weights.timeouts``). Any
failure raises ``WeightTransferError`` (reason "collective"); the replica then loads the version over ZeroMQ, so a
member that dies mid-push costs the others a retry, never a wrong version.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from secrets import token_hex
from typing import Any

import torch
import torch.distributed as dist
import zmq

from fleetrl.weights.collective_plan import (
    CLOSED,
    COLLECTIVE_BACKENDS,
    DEFAULT_BUCKET_BYTES,
    JOIN_TIMEOUT_S,
    Bucket,
    choose_backend,
    claimed_rank_offset,
    device_type,
    flat_layout,
    plan_buckets,
    plan_ops,
    receive_device,
    world_size_at_close,
)
from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.manifest import Manifest, checksum_bytes, decode_manifest, encode_manifest
from fleetrl.weights.protocol import PROTOCOL, parse_error
from fleetrl.weights.timeouts import transfer_timeout_s

__all__ = [
    "COLLECTIVE_BACKENDS",
    "JOIN_TIMEOUT_S",
    "CollectiveSender",
    "GroupOffer",
    "Membership",
    "choose_backend",
    "fetch_collective",
    "join_group",
    "receive_into",
    "receive_state_dict",
    "request_group",
]

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# gloo moves a large tensor far slower than the same bytes in 8 MiB operations on this VM: 0.8 GB/s per 64 MiB op vs
# 3.1 GB/s per 8 MiB op, 2.2 GB/s at 4 and 16 MiB (two processes over loopback, pre-faulted buffers, 196 MB).
GLOO_OP_BYTES = 8 << 20
SMALL_PIECE_BYTES = 1 << 20  # pieces below this are packed into one broadcast; larger ones go on their own, uncopied
_POLL_S = 0.01
_REPLICAS_KEY = "replicas"
_RANKS_KEY = "ranks"
_WORLD_KEY = "world"


@dataclass(frozen=True)
class GroupOffer:
    """What a replica needs to join a version's group (the weight stream's answer to ``request_group``)."""

    host: str
    port: int
    group: str
    backend: str
    bucket_bytes: int
    join_timeout_s: float
    timeout_s: float
    manifest: Manifest
    trainer_device: str = "cpu"  # where the trainer runs ("cuda": it broadcasts from its GPU under NCCL)
    replica_device: str = "cpu"  # the device the replica that opened the group named (its receivers' under NCCL)

    def to_json(self) -> dict[str, Any]:
        """Everything but the manifest (sent in its own frame)."""
        return {
            "host": self.host,
            "port": self.port,
            "group": self.group,
            "backend": self.backend,
            "bucket_bytes": self.bucket_bytes,
            "join_timeout_s": self.join_timeout_s,
            "timeout_s": self.timeout_s,
            "trainer_device": self.trainer_device,
            "replica_device": self.replica_device,
        }

    @classmethod
    def from_json(cls, fields: dict[str, Any], manifest: Manifest) -> GroupOffer:
        return cls(
            host=str(fields["host"]),
            port=int(fields["port"]),
            group=str(fields["group"]),
            backend=str(fields["backend"]),
            bucket_bytes=int(fields["bucket_bytes"]),
            join_timeout_s=float(fields["join_timeout_s"]),
            timeout_s=float(fields["timeout_s"]),
            manifest=manifest,
            trainer_device=str(fields.get("trainer_device", "cpu")),
            replica_device=str(fields.get("replica_device", "cpu")),
        )


@dataclass(frozen=True)
class Membership:
    """A replica's place in a group: its first rank (one per receiving worker from there) and the world size."""

    rank_offset: int
    world_size: int


def _store(host: str, port: int, *, master: bool, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, None, master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True
    )


def _process_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    prefix = dist.PrefixStore("pg/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, world_size, options)
    raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")


def _broadcast(group: Any, buffer: torch.Tensor, timeout_s: float) -> None:
    """Broadcast `buffer` from rank 0; on gloo in slices of ``GLOO_OP_BYTES`` (both ends slice alike)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timedelta(seconds=timeout_s)
    step = GLOO_OP_BYTES if buffer.device.type == "cpu" else max(buffer.numel(), 1)
    for start in range(0, buffer.numel(), step):
        group.broadcast([buffer[start : start + step]], options).wait()


def _shutdown(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # teardown only
            logger.debug("process group shutdown failed", exc_info=True)


class CollectiveSender:
    """Rank 0 of one version's group: opens the rendezvous store, waits for the replicas, broadcasts the buckets.

    ``payloads`` are the raw bytes of the manifest's tensors (the publisher's snapshot, kept alive by this object
    until the push ends). `device` is where the trainer runs: under NCCL (a CUDA device) each bucket is copied into one
    reused buffer of the bucket size there and broadcast from it; under gloo the buffer is host memory and large pieces
    go from the snapshot uncopied. ``start()`` runs the push in a background thread; ``done`` is set when it ends, with
    ``error`` (a string) on failure and ``world_size`` the group's size (1: nobody joined, nothing sent).
    """

    def __init__(
        self,
        manifest: Manifest,
        payloads: tuple[memoryview, ...],
        *,
        expected_replicas: int,
        host: str = "0.0.0.0",
        backend: str = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        timeout_s: float = 300.0,
        device: str = "cpu",
        replica_device: str = "cpu",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")
        self.device = torch.device(receive_device(backend, device))  # ValueError: NCCL off CUDA
        self.trainer_device = device_type(device)
        self.replica_device = device_type(replica_device)
        if expected_replicas < 1:
            raise ValueError(f"expected_replicas must be >= 1, got {expected_replicas}")
        if not (join_timeout_s > 0 and timeout_s > 0):
            raise ValueError("join_timeout_s and timeout_s must be positive")
        self.manifest = manifest
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s
        self.expected_replicas = expected_replicas
        # The name prefixes every key of the group in the store: unguessable, so only a replica the weight stream
        # gave the offer (auth token checked there) finds the group's keys.
        self.group = f"v{manifest.version}-{token_hex(16)}"
        self.buckets = plan_buckets([t.nbytes for t in manifest.tensors], bucket_bytes)
        self._payloads = payloads
        self._budget_s = transfer_timeout_s(timeout_s, manifest.total_bytes)
        self._store = _store(host, 0, master=True, timeout_s=self._budget_s)
        self.port = int(self._store.port)
        self._cancelled = threading.Event()
        self.closed = threading.Event()  # no claim is a member from now on
        self.done = threading.Event()
        self.error = ""
        self.world_size = 0
        self.send_s = 0.0
        self.buffer_bytes = 0  # the reused bucket buffer on `device` (the largest bucket)
        self._thread = threading.Thread(target=self._run, name=f"fleetrl-collective-{self.group}", daemon=True)

    def offer(self, host: str) -> GroupOffer:
        """The offer a replica that reached the trainer at `host` gets."""
        return GroupOffer(
            host=host,
            port=self.port,
            group=self.group,
            backend=self.backend,
            bucket_bytes=self.bucket_bytes,
            join_timeout_s=self.join_timeout_s,
            timeout_s=self.timeout_s,
            manifest=self.manifest,
            trainer_device=self.trainer_device,
            replica_device=self.replica_device,
        )

    def start(self) -> CollectiveSender:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def cancel(self, timeout_s: float = 10.0) -> None:
        """Stop waiting for replicas (the publisher is closing): the group closes and nothing is sent; members that
        had joined time out and load over ZeroMQ. Waits up to `timeout_s` for the thread (a broadcast under way
        runs to its own bound)."""
        self._cancelled.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        store = dist.PrefixStore(f"{self.group}/", self._store)
        try:
            deadline = time.monotonic() + self.join_timeout_s
            while store.add(_REPLICAS_KEY, 0) < self.expected_replicas and time.monotonic() < deadline:
                if self._cancelled.wait(_POLL_S):
                    break
            self.world_size = world_size_at_close(store.add(_RANKS_KEY, CLOSED))
            self.closed.set()
            store.set(_WORLD_KEY, str(self.world_size))
            if self._cancelled.is_set():
                raise RuntimeError("cancelled: the weight publisher is closing")
            if self.world_size == 1:
                logger.info("collective push of version %d: no replica joined", self.manifest.version)
                return
            start = time.perf_counter()
            if self.device.type == "cuda":  # this thread's current device is the trainer's (NCCL binds to it)
                if self.device.index is None:  # "cuda": the process's current device (set_device needs an index)
                    self.device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(self.device)
            group = _process_group(store, 0, self.world_size, self.backend, self._budget_s)
            try:
                self._send(group)
            finally:
                _shutdown(group)
            self.send_s = time.perf_counter() - start
            logger.info(
                "collective push of version %d: %d bytes to %d ranks in %.3f s",
                self.manifest.version,
                self.manifest.total_bytes,
                self.world_size - 1,
                self.send_s,
            )
        except Exception as exc:  # the receivers time out and fall back to ZeroMQ; report it here
            logger.warning("collective push of version %d failed: %r", self.manifest.version, exc)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._payloads = ()  # the snapshot may go once the publisher drops it
            self.closed.set()
            self.done.set()

    def _send(self, group: Any) -> None:
        with warnings.catch_warnings():  # the snapshot's views are read-only; rank 0 of a broadcast only reads
            warnings.simplefilter("ignore", UserWarning)
            sources = [torch.frombuffer(p, dtype=torch.uint8) if len(p) else None for p in self._payloads]
        largest = max((b.nbytes for b in self.buckets), default=0)
        # One buffer of the bucket size on the broadcast device, reused for every bucket of the push (on CUDA the
        # caching allocator hands the same block to the next push).
        buffer = torch.empty(largest, dtype=torch.uint8, device=self.device)
        self.buffer_bytes = largest
        for bucket in self.buckets:
            for start, stop in plan_ops(bucket, SMALL_PIECE_BYTES):
                inside = [p for p in bucket.pieces if start <= p.offset < stop]
                if len(inside) == 1:  # one tensor's bytes: broadcast them where they lie if that is the device
                    (piece,) = inside
                    source = sources[piece.tensor_index]
                    assert source is not None
                    if source.device == self.device:
                        _broadcast(group, source[piece.start : piece.stop], self._budget_s)
                        continue
                op = buffer[start:stop]
                for piece in inside:
                    source = sources[piece.tensor_index]
                    assert source is not None
                    at = piece.offset - start
                    op[at : at + piece.stop - piece.start].copy_(source[piece.start : piece.stop])
                _broadcast(group, op, self._budget_s)


def request_group(
    address: str,
    version: int,
    *,
    replicas: int,
    auth_token: str | None = None,
    timeout_s: float = 30.0,
    device: str = "cpu",
) -> GroupOffer:
    """Ask the weight stream at `address` for the group of `version` (opening it, expecting `replicas` replicas),
    naming the replica's `device` (the trainer chooses the backend from it and its own); WeightTransferError when it
    refuses (a relay, an unknown version, a backend this device cannot use) or does not answer within `timeout_s`."""
    device = device_type(device)
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        request = json.dumps(
            {"version": version, "replicas": replicas, "timeout_s": timeout_s, "device": device}
        ).encode()
        socket.send_multipart([PROTOCOL, b"collective", (auth_token or "").encode(), request])
        if not socket.poll(int(timeout_s * 1000)):
            raise WeightTransferError(
                f"the weight stream at {address} did not offer a group for version {version} within {timeout_s:g} s",
                reason="timeout",
            )
        frames = socket.recv_multipart()
    finally:
        socket.close(linger=0)
    if frames[0] == b"error" and len(frames) == 2:
        reason, message = parse_error(frames[1])
        message = f"the weight stream at {address} refused the collective push: {message}"
        raise WeightTransferError(message, reason=reason)
    if frames[0] != b"collective" or len(frames) != 3:
        raise WeightTransferError(f"unexpected reply to a collective request from {address}", reason="protocol")
    try:
        manifest = decode_manifest(frames[2])
        offer = GroupOffer.from_json({**json.loads(frames[1]), "host": _host_of(address)}, manifest)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise WeightTransferError(f"bad collective offer from {address}: {exc}", reason="protocol") from exc
    if manifest.version != version:
        raise WeightTransferError(f"asked for version {version}, offered {manifest.version}", reason="protocol")
    return offer


def encode_offer(sender: CollectiveSender) -> tuple[bytes, bytes]:
    """The weight stream's reply frames for `sender`'s group (the host is the one the replica dialled)."""
    fields = sender.offer("").to_json()
    del fields["host"]
    return json.dumps(fields).encode(), encode_manifest(sender.manifest)


def _host_of(address: str) -> str:
    """The host of a ``tcp://host:port`` address ("[::1]" loses its brackets)."""
    rest = address.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


def join_group(offer: GroupOffer, ranks: int) -> Membership | None:
    """Claim `ranks` ranks in `offer`'s group and wait for it to close; None when it had closed already (load the
    version over ZeroMQ). WeightTransferError when the store cannot be reached or the group never closes."""
    wait_s = offer.join_timeout_s + offer.timeout_s
    try:
        store = dist.PrefixStore(f"{offer.group}/", _store(offer.host, offer.port, master=False, timeout_s=wait_s))
        offset = claimed_rank_offset(store.add(_RANKS_KEY, ranks), ranks)
        if offset is None:
            return None
        store.add(_REPLICAS_KEY, 1)
        world_size = int(store.get(_WORLD_KEY))
    except (RuntimeError, ValueError, dist.DistStoreError) as exc:
        raise WeightTransferError(
            f"could not join the group of version {offer.manifest.version} at {offer.host}:{offer.port}: {exc}",
            reason="collective",
        ) from exc
    return Membership(offset, world_size)


def receive_into(
    offer: GroupOffer,
    rank: int,
    world_size: int,
    flat: torch.Tensor,
    *,
    skip: frozenset[str] = frozenset(),
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Build the group as `rank` of `world_size`, receive every bucket into `flat` (a uint8 buffer of
    ``flat_layout`` of the manifest's sizes, on ``receive_device(offer.backend, ...)``: the receiver's GPU under NCCL,
    host memory under gloo) and return the manifest's tensors as views of it, each checked against its checksum when
    `verify` (a GPU buffer is read back to host for that; names in `skip` are received but not returned)."""
    manifest = offer.manifest
    offsets, size = flat_layout([t.nbytes for t in manifest.tensors])
    if flat.numel() < size or flat.dtype != torch.uint8:
        raise ValueError(f"the receive buffer holds {flat.numel()} bytes, the version needs {size} (uint8)")
    if receive_device(offer.backend, str(flat.device)) != str(flat.device):
        raise ValueError(f"a {offer.backend} receiver's buffer lives in host memory, got one on {flat.device}")
    budget_s = transfer_timeout_s(offer.timeout_s, manifest.total_bytes)
    try:
        if flat.device.type == "cuda":  # NCCL binds the group to this thread's current device
            torch.cuda.set_device(flat.device)
        store = dist.PrefixStore(f"{offer.group}/", _store(offer.host, offer.port, master=False, timeout_s=budget_s))
        group = _process_group(store, rank, world_size, offer.backend, budget_s)
        try:
            for bucket in plan_buckets([t.nbytes for t in manifest.tensors], offer.bucket_bytes):
                _receive_bucket(group, bucket, offsets, flat, budget_s)
            if flat.device.type == "cuda":  # the broadcasts ran on NCCL's stream: the bytes are there for any reader
                torch.cuda.synchronize(flat.device)
        finally:
            _shutdown(group)
    except (RuntimeError, ValueError, dist.DistError) as exc:
        raise WeightTransferError(
            f"the collective push of version {manifest.version} failed at rank {rank}: {exc}", reason="collective"
        ) from exc
    tensors: dict[str, torch.Tensor] = {}
    for spec, offset in zip(manifest.tensors, offsets, strict=True):
        raw = flat[offset : offset + spec.nbytes]
        if verify and checksum_bytes(memoryview(raw.cpu().numpy())) != spec.checksum:
            raise WeightTransferError(
                f"tensor {spec.name!r} of version {manifest.version} failed its checksum after the collective push",
                reason="checksum",
            )
        if spec.name not in skip:
            tensors[spec.name] = raw.view(spec.torch_dtype).view(spec.shape)
    return tensors


def _receive_bucket(
    group: Any,
    bucket: Bucket,
    offsets: tuple[int, ...],
    flat: torch.Tensor,
    budget_s: float,
) -> None:
    """One bucket: straight into `flat` when its pieces lie there as in the bucket (the usual case: both layouts
    align each tensor to 64 bytes in the same order), else through a scratch buffer on `flat`'s device."""
    shifts = {offsets[p.tensor_index] + p.start - p.offset for p in bucket.pieces}
    base = shifts.pop() if len(shifts) == 1 else -1
    direct = base >= 0 and base + bucket.nbytes <= flat.numel()
    for start, stop in plan_ops(bucket, SMALL_PIECE_BYTES):
        if direct:
            _broadcast(group, flat[base + start : base + stop], budget_s)
            continue
        scratch = torch.empty(stop - start, dtype=torch.uint8, device=flat.device)
        _broadcast(group, scratch, budget_s)
        for piece in bucket.pieces:
            if start <= piece.offset < stop:
                at, length = offsets[piece.tensor_index] + piece.start, piece.stop - piece.start
                flat[at : at + length].copy_(scratch[piece.offset - start : piece.offset - start + length])


def receive_state_dict(
    offer: GroupOffer,
    membership: Membership,
    *,
    skip: frozenset[str] = frozenset(),
    verify: bool = True,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Receive `offer`'s version as one rank (the replica's first) into a fresh buffer: the hf engine's path. The
    buffer is on `device` (the replica's) under NCCL, in host memory under gloo."""
    _, size = flat_layout([t.nbytes for t in offer.manifest.tensors])
    flat = torch.empty(size, dtype=torch.uint8, device=receive_device(offer.backend, device))
    return receive_into(offer, membership.rank_offset, membership.world_size, flat, skip=skip, verify=verify)


def fetch_collective(
    address: str,
    version: int,
    *,
    replicas: int,
    auth_token: str | None = None,
    timeout_s: float = 300.0,
    device: str = "cpu",
) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
    """One rank's whole collective load of `version` (ask, join, receive, verify) on a replica on `device`: the
    manifest and the tensors (on `device` under NCCL), or None when the group had closed before this replica joined.
    WeightTransferError on any failure; the caller loads the version over the weight stream instead, either way."""
    offer = request_group(
        address, version, replicas=replicas, auth_token=auth_token, timeout_s=timeout_s, device=device
    )
    membership = join_group(offer, 1)
    if membership is None:
        return None
    return offer.manifest, receive_state_dict(offer, membership, device=device)
