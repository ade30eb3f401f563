"""The publishing end of the weight stream: ``WeightPublisher`` serves state dicts over ZeroMQ.

The trainer calls ``publish(version, state_dict)``; the serving loop (``fleetrl.weights.server``, shared
with the relay) answers any number of concurrent fetches (``fleetrl.weights.fetch``) following
``fleetrl.weights.protocol``. Tensor bytes are sent as memoryviews of the published snapshot with
``copy=False``. Requests come from anyone who can reach the port; the shared loop makes sure none
stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import zmq

from fleetrl.weights.collective_plan import (
    COLLECTIVE_BACKENDS,
    DEFAULT_BUCKET_BYTES,
    JOIN_TIMEOUT_S,
    choose_backend,
    device_type,
)
from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.gather import gather_shards
from fleetrl.weights.manifest import Manifest, dtype_name, encode_manifest, spec_for_tensor, tensor_bytes
from fleetrl.weights.server import MAX_REQUEST_BYTES, Deferred, Refusal, Session, WeightStreamServer
from fleetrl.weights.staging import HostStaging, ServedBuffers
from fleetrl.weights.timeouts import transfer_timeout_s

__all__ = ["MAX_REQUEST_BYTES", "WeightPublisher", "gather_shards"]

logger = logging.getLogger(__name__)

_STAGE_TIMEOUT_S = 300.0  # the floor of a wait for the previous version's staging (plus its bytes at 100 MB/s)


@dataclass
class _Snapshot:
    """A published version as served: its manifest (also encoded) and the bytes of each tensor."""

    manifest: Manifest
    manifest_bytes: bytes
    payloads: tuple[memoryview, ...]  # raw bytes of each tensor, views of `tensors`
    tensors: tuple[torch.Tensor, ...]


class WeightPublisher(WeightStreamServer):
    """Serves the latest published weight versions to any number of concurrent receivers.

    ``publish`` snapshots a state dict (a contiguous CPU copy, so the trainer may keep updating
    its parameters) and makes it fetchable; the newest ``keep_versions`` versions stay available.
    The serving loop runs in a background thread; if it fails, the failure is logged and raised
    as WeightTransferError by the next ``publish`` or ``close``. With ``auth_token`` set, a fetch
    without that token is refused. ``counts`` (``snapshot_counts()``): "requests" handled,
    "manifests_served" (fetches begun), "bytes_served" (tensor bytes sent),
    "requests_refused/<reason>" (protocol, auth, unknown_version, unknown_session, busy, internal),
    "sessions_expired" (fetch sessions idle past ``session_timeout_s``, looked for every
    ``session_sweep_s``) and "manifests_deferred" (fetches that asked for a version still being staged).

    ``publish(..., background=True)`` returns once the state dict is copied (and cast) into reused host
    buffers (``fleetrl.weights.staging``) and hashes and serves it in a background thread: the version
    is fetchable at once (a fetch of it waits until it is ready) and the returned Future gives its
    manifest. Memory: the served versions (``keep_versions``) plus one staged version in the reused
    buffers; a publish while the previous version is still being staged waits for it first.

    A replica asking for a version's group (``weight_transport = "collective"``) opens one ``CollectiveSender`` per
    push (``fleetrl.weights.collective``), its backend chosen from ``collective_backend`` ("auto", "gloo", "nccl"), the
    trainer's ``collective_device`` and the device the replica's request names (``collective_plan.choose_backend``); a
    replica whose device cannot use the open group's backend is refused (it loads over ZeroMQ). It keeps that
    version's snapshot alive until the broadcast ends, so memory stays one served copy per version.
    """

    name = "weight publisher"

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        *,
        chunk_bytes: int = 1 << 30,
        auth_token: str | None = None,
        keep_versions: int = 2,
        session_timeout_s: float = 300.0,
        session_sweep_s: float = 1.0,
        start_timeout_s: float = 10.0,
        collective_backend: str = "auto",
        collective_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        collective_join_timeout_s: float = JOIN_TIMEOUT_S,
        collective_device: str = "cpu",
    ) -> None:
        if collective_backend not in COLLECTIVE_BACKENDS:
            raise ValueError(f"collective_backend must be one of {COLLECTIVE_BACKENDS}, got {collective_backend!r}")
        try:
            device_type(collective_device)
        except ValueError as exc:
            raise ValueError(f"collective_device: {exc}") from None
        if collective_backend == "nccl" and device_type(collective_device) != "cuda":
            raise ValueError(
                f"collective_backend 'nccl' needs the trainer on CUDA, got collective_device {collective_device!r}"
            )
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if not isinstance(keep_versions, int) or keep_versions < 1:
            raise ValueError(f"keep_versions must be an int >= 1, got {keep_versions!r}")
        super().__init__(auth_token=auth_token, session_timeout_s=session_timeout_s, session_sweep_s=session_sweep_s)
        self.chunk_bytes = chunk_bytes
        self.keep_versions = keep_versions
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, _Snapshot] = OrderedDict()  # guarded by _lock
        self._latest: int | None = None
        self._closed = False
        # Background publishing: one staged version at a time (guarded by _lock where the loop reads it).
        self._staging = HostStaging()
        self._served = ServedBuffers()  # the stager's copies of the versions it serves (stager thread only)
        self._stager: ThreadPoolExecutor | None = None
        self._staged: Future[Manifest] | None = None
        self._staging_version: int | None = None
        self._failed_stage: tuple[int, BaseException] | None = None
        self.stage_waits = 0  # publishes that waited for the previous version's staging to finish
        # Collective pushes (fleetrl.weights.collective): the open group of each version (serving thread only).
        self.collective_backend = collective_backend
        self.collective_device = collective_device
        self.collective_bucket_bytes = collective_bucket_bytes
        self.collective_join_timeout_s = collective_join_timeout_s
        self._bind_host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
        self._groups: dict[int, Any] = {}
        self.collective_senders: deque[Any] = deque(maxlen=8)  # the last groups opened (tests and benchmarks)
        # The stager wakes the serving loop when a version is served (or failed), so that a fetch waiting for it is
        # answered at once rather than at the loop's next poll timeout (up to 100 ms later).
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        try:
            self._start_serving(bind, start_timeout_s, "fleetrl-weight-publisher")
        except WeightTransferError:
            self._closed = True
            os.close(self._wake_write)
            raise

    # -- public API ---------------------------------------------------------------------------

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions a new fetch can get, oldest first."""
        with self._lock:
            return tuple(self._versions)

    @property
    def staged_version(self) -> int | None:
        """The version being cast and hashed in the background (fetches of it wait), or None."""
        with self._lock:
            return self._staging_version

    @property
    def staging_allocations(self) -> int:
        """How many times the staging buffers were allocated (once while the tensors' sizes stay the same)."""
        return self._staging.allocations

    @property
    def served_allocations(self) -> int:
        """How many sets of served buffers the stager allocated (keep_versions + 1 while sizes stay the same)."""
        return self._served.allocations

    def version_bytes(self, version: int) -> int:
        """Bytes `version` moves on the stream (served, or being staged); 0 for a version this publisher lacks."""
        with self._lock:
            snapshot = self._versions.get(version)
            if snapshot is not None:
                return snapshot.manifest.total_bytes
            if version == self._staging_version:
                return self._staging.nbytes
        return 0

    def version_tensors(self, version: int, timeout_s: float = _STAGE_TIMEOUT_S) -> dict[str, torch.Tensor]:
        """The served tensors of `version` (the served dtype and shape: the bytes the stream serves), waiting up to
        `timeout_s` for it to finish staging; KeyError when this publisher does not hold it. Holding them keeps
        their buffers from being reused (ServedBuffers) until the caller drops them: a weight-transfer engine
        sends a version from here while the trainer trains the next (fleetrl.weights.engine_push)."""
        with self._lock:
            staged = self._staged if version == self._staging_version else None
        if staged is not None:
            staged.result(timeout=timeout_s)  # raises what the staging raised
        with self._lock:
            snapshot = self._versions.get(version)
            available = list(self._versions)
        if snapshot is None:
            raise KeyError(f"weight version {version} is not held by the publisher (it has {available})")
        names = [spec.name for spec in snapshot.manifest.tensors]
        return dict(zip(names, snapshot.tensors, strict=True))

    def snapshot_counts(self) -> dict[str, int]:
        """A copy of the request counters."""
        return dict(self.counts)

    def publish(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        adapter: Mapping[str, Any] | None = None,
        float_dtype: torch.dtype | None = None,
        background: bool = False,
        sharded: bool = False,
    ) -> Any:
        """Snapshot ``state_dict`` as ``version`` (greater than any published before) and serve it.

        ``adapter``: for a LoRA run, the PEFT adapter config; ``state_dict`` then holds only the
        adapter's tensors (see ``Manifest.adapter``). ``float_dtype``: floating tensors are cast to it in
        the snapshot copy (the dtype the replicas serve; None keeps each tensor's own).

        Returns the Manifest; with ``background``, a Future of it: the call returns once the tensors
        are copied (and cast) into the reused staging buffers (the caller may change them from then on), and the
        checksums and serving follow in a background thread (see the class docstring).

        ``sharded`` (world size > 1; implies ``background``): ``state_dict`` is the sharded model's own
        (``model.state_dict()``: DTensor shards), gathered one tensor at a time straight into the staging buffers,
        cast on the device (``HostStaging.gather``). Every other rank calls ``gather_shards`` with its state dict at
        the same time; nobody gathers the whole model. A sharded publish refused before its gathers (a version not
        newer, a closed publisher, the previous staging failed) still takes part in them, then raises: the other
        ranks are gathering already, and would otherwise wait for rank 0 until the process group's timeout.
        """
        if sharded:
            try:
                self._check_publishable(version)
            except (ValueError, WeightTransferError):
                gather_shards(state_dict, float_dtype)  # the other ranks' gathers complete; nothing is kept
                raise
            try:
                return self._stage(version, state_dict, adapter, float_dtype, sharded)
            except _Refused as refused:
                gather_shards(state_dict, float_dtype)
                raise refused.error from refused.error.__cause__
        self._check_publishable(version)
        if background:
            return self._stage(version, state_dict, adapter, float_dtype, sharded)
        started = time.perf_counter()
        snapshot = self._snapshot(version, state_dict, adapter, float_dtype)
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"weight version {version} is not newer than the last published {self._latest}")
            self._latest = version
            self._keep(version, snapshot)
        return _logged(snapshot.manifest, started, "")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and release the socket; raises if the serving loop had failed."""
        if self._closed:
            return
        self._closed = True
        if self._stager is not None:  # a version being staged finishes first (its Future is someone's)
            self._stager.shutdown(wait=True)
        self._stop.set()
        self._wake()
        self._stop_serving(timeout_s)
        os.close(self._wake_write)
        for sender in self._groups.values():  # the loop has stopped: no new group opens now
            sender.cancel(timeout_s)
        self._groups.clear()
        with self._lock:
            self._versions.clear()
        self._raise_if_failed()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- test hook ----------------------------------------------------------------------------

    def _chunk_payload(self, snapshot: _Snapshot, tensor_index: int, start: int, stop: int) -> Any:
        """The bytes sent for a chunk (a view of the snapshot; tests override to corrupt them)."""
        return snapshot.payloads[tensor_index][start:stop]

    # -- internals ----------------------------------------------------------------------------

    def _check_publishable(self, version: int) -> None:
        self._check_usable()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"weight version must be a non-negative int, got {version!r}")
        if self._latest is not None and version <= self._latest:
            raise ValueError(f"weight version {version} is not newer than the last published {self._latest}")

    def _check_usable(self) -> None:
        self._raise_if_failed()
        if self._closed:
            raise WeightTransferError("weight publisher is closed", reason="publisher")

    def _snapshot(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        adapter: Mapping[str, Any] | None = None,
        float_dtype: torch.dtype | None = None,
    ) -> _Snapshot:
        _check_state_dict(state_dict, float_dtype)
        tensors: list[torch.Tensor] = []
        for tensor in state_dict.values():
            # One copy from any device straight into fresh contiguous CPU memory (cast on the way if asked).
            dtype = float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype
            copy = torch.empty(tuple(tensor.shape), dtype=dtype, device="cpu")
            copy.copy_(tensor.detach())
            tensors.append(copy)
        return _build_snapshot(version, list(state_dict), tensors, adapter)

    # -- background publishing ------------------------------------------------------------------

    def _stage(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        adapter: Mapping[str, Any] | None,
        float_dtype: torch.dtype | None,
        sharded: bool = False,
    ) -> Future[Manifest]:
        started = time.perf_counter()
        try:
            self._check_stageable(state_dict, float_dtype, sharded)
        except (TypeError, ValueError, WeightTransferError) as exc:
            if sharded:
                raise _Refused(exc) from exc
            raise
        if sharded:  # every rank gathers with us, one tensor at a time (fleetrl.weights.staging.HostStaging.gather)
            views, ready = self._staging.gather(state_dict.values(), float_dtype)
        else:
            views, ready = self._staging.snapshot(state_dict.values(), float_dtype)
        return self._submit_stage(version, state_dict, views, ready, adapter, float_dtype, started, sharded)

    def _check_stageable(
        self, state_dict: Mapping[str, torch.Tensor], float_dtype: torch.dtype | None, sharded: bool
    ) -> None:
        """What must hold before a version is copied: the state dict can travel, the previous version is staged."""
        _check_state_dict(state_dict, float_dtype, sharded)
        previous = self._staged
        if previous is not None and not previous.done():
            self.stage_waits += 1  # bounded memory: one staged version beyond the served ones
            try:  # local work (a cast and checksums): bounded like a transfer of its bytes
                previous.exception(timeout=transfer_timeout_s(_STAGE_TIMEOUT_S, self._staging.nbytes))
            except FutureTimeoutError:
                raise WeightTransferError(
                    "the previous weight version is still being staged; not publishing another", reason="publisher"
                ) from None
        if previous is not None and previous.exception() is not None:
            self._staged = None
            raise WeightTransferError(
                f"staging the previous weight version failed: {previous.exception()!r}", reason="publisher"
            ) from previous.exception()

    def _submit_stage(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        views: list[torch.Tensor],
        ready: Any,
        adapter: Mapping[str, Any] | None,
        float_dtype: torch.dtype | None,
        started: float,
        sharded: bool,
    ) -> Future[Manifest]:
        """The copied version handed to the stager (checksums and serving follow in its thread)."""
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"weight version {version} is not newer than the last published {self._latest}")
            self._latest = version
            self._staging_version = version
        if self._stager is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetrl-weight-stager")
        names = list(state_dict)
        future = self._stager.submit(self._run_stage, version, names, views, ready, adapter, float_dtype, started)
        self._staged = future
        logger.info(
            "staged weights version %d: %d tensors, %.1f MB in %.2fs%s (cast, checksums and serving follow)",
            version,
            len(names),
            sum(v.numel() * v.element_size() for v in views) / 1e6,
            time.perf_counter() - started,
            ", gathered shard by shard" if sharded else "",
        )
        return future

    def _run_stage(self, version: int, *args: Any) -> Manifest:
        """The stager's task: `_finish_stage`, and on a failure the version is refused from then on (its waiting
        fetches with it) and the Future carries the error."""
        try:
            return self._finish_stage(version, *args)
        except BaseException as exc:
            logger.exception("staging weights version %d failed", version)
            with self._lock:
                self._failed_stage = (version, exc)
                if self._staging_version == version:
                    self._staging_version = None
            self._wake()  # its waiting fetches are refused now
            raise

    def _finish_stage(
        self,
        version: int,
        names: list[str],
        views: Sequence[torch.Tensor],
        ready: Any,
        adapter: Mapping[str, Any] | None,
        float_dtype: torch.dtype | None,
        started: float,
    ) -> Manifest:
        """In the stager thread: the served copy of a staged version, its checksums, then serving."""
        if ready is not None:
            ready.synchronize()
        # Already in the served dtype (the staging copy cast them): copied into reused memory, never fresh.
        tensors, payloads = self._served.copy(views)
        snapshot = _build_snapshot(version, names, tensors, adapter, payloads)
        with self._lock:
            self._staging_version = None
            self._keep(version, snapshot)
        self._wake()  # the fetches waiting for it are answered now
        return _logged(snapshot.manifest, started, " (staged in the background)")

    def _wake(self) -> None:
        # A full pipe: the loop is awake anyway; a closed one (the publisher was closed): nobody to wake.
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"!")

    def _keep(self, version: int, snapshot: Any) -> None:
        """Serve `snapshot` as `version`, keeping the newest `keep_versions` (the caller holds the lock)."""
        self._versions[version] = snapshot
        while len(self._versions) > self.keep_versions:
            self._versions.popitem(last=False)

    # -- serving: the shared loop (fleetrl.weights.server) asks for these ---------------------

    def _wake_fd(self) -> int | None:
        return self._wake_read

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass

    def _serve_finished(self) -> None:
        os.close(self._wake_read)

    def _open_session(self, version: int) -> tuple[Manifest, bytes, Any]:
        with self._lock:
            snapshot = self._versions.get(version)
            available = list(self._versions)
            staging, failed = self._staging_version, self._failed_stage
        if snapshot is None and version == staging:
            raise Deferred()  # answered once the stager has cast and hashed it
        if snapshot is None and failed is not None and failed[0] == version:
            raise Refusal("internal", f"weight version {version} could not be staged: {failed[1]!r}")
        if snapshot is None:
            message = f"weight version {version} is not available; the publisher has {available}"
            raise Refusal("unknown_version", message)
        return snapshot.manifest, snapshot.manifest_bytes, snapshot

    def _open_collective(
        self, version: int, replicas: int, timeout_s: float, device: str = "cpu"
    ) -> tuple[bytes, bytes]:
        """The open group of `version`, or a new one (the first replica to ask opens it; one group per push), for a
        replica on `device`; Refusal ("unsupported") when that device cannot use the group's backend."""
        from fleetrl.weights.collective import CollectiveSender, encode_offer

        _, _, snapshot = self._open_session(version)  # Deferred while staging, Refusal when unknown
        if snapshot.manifest.is_adapter:
            raise Refusal("unsupported", f"weight version {version} is a LoRA adapter: it goes over the weight stream")
        for done in [v for v, g in self._groups.items() if g.closed.is_set()]:
            del self._groups[done]
        try:
            backend = choose_backend(self.collective_backend, self.collective_device, device)
        except ValueError as exc:
            raise Refusal("unsupported", str(exc)) from None
        sender = self._groups.get(version)
        if sender is not None and sender.backend != backend:
            message = (
                f"the group of weight version {version} broadcasts over {sender.backend} (opened for a replica on "
                f"{sender.replica_device}); a replica on {device} would need {backend}: load it over the weight stream"
            )
            raise Refusal("unsupported", message)
        if sender is None:
            sender = CollectiveSender(
                snapshot.manifest,
                snapshot.payloads,
                expected_replicas=replicas,
                host=self._bind_host,
                backend=backend,
                device=self.collective_device,
                replica_device=device,
                bucket_bytes=self.collective_bucket_bytes,
                join_timeout_s=self.collective_join_timeout_s,
                timeout_s=timeout_s,
            ).start()
            self._groups[version] = sender
            self.collective_senders.append(sender)
        return encode_offer(sender)

    def _answer_chunk(
        self, sock: zmq.Socket, peer: bytes, session: Session, header: bytes, tensor_index: int, start: int, stop: int
    ) -> None:
        payload = self._chunk_payload(session.source, tensor_index, start, stop)
        if self._send(sock, peer, [b"chunk", header, payload]):
            self.counts["bytes_served"] += stop - start


class _Refused(Exception):
    """A sharded publish refused before its gathers (internal: `publish` takes part in them, then raises `error`)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _check_state_dict(
    state_dict: Mapping[str, torch.Tensor], float_dtype: torch.dtype | None, sharded: bool = False
) -> None:
    """TypeError / ValueError naming the entry that cannot travel."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict keys must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense travels")
        if not sharded and hasattr(tensor, "full_tensor"):
            raise ValueError(f"tensor {name!r} is a DTensor shard: publish a sharded model with sharded=True")
        try:
            dtype_name(tensor.dtype)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
    if float_dtype is not None:
        dtype_name(float_dtype)  # one that can travel
        if not float_dtype.is_floating_point:
            raise ValueError(f"float_dtype must be a floating dtype, got {float_dtype}")


def _build_snapshot(
    version: int,
    names: list[str],
    tensors: list[torch.Tensor],
    adapter: Mapping[str, Any] | None,
    payloads: list[memoryview] | None = None,
) -> _Snapshot:
    """The served form of contiguous CPU tensors: manifest (checksums computed), encoded manifest, payload views
    (given, or made here)."""
    manifest = Manifest.build(
        version, tuple(spec_for_tensor(n, t) for n, t in zip(names, tensors, strict=True)), adapter
    )
    return _Snapshot(
        manifest=manifest,
        manifest_bytes=encode_manifest(manifest),
        payloads=tuple(tensor_bytes(t) for t in tensors) if payloads is None else tuple(payloads),
        tensors=tuple(tensors),
    )


def _logged(manifest: Manifest, started: float, how: str) -> Manifest:
    logger.info(
        "published weights version %d: %d tensors, %.1f MB, checksum %s, in %.2fs%s",
        manifest.version,
        len(manifest.tensors),
        manifest.total_bytes / 1e6,
        manifest.checksum,
        time.perf_counter() - started,
        how,
    )
    return manifest
