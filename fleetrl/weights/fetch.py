"""The receiving end of the weight stream: ``fetch_weights`` and ``iter_weights`` over ZeroMQ.

A tensor of at most the publisher's ``chunk_bytes`` arrives as one message that the receiver keeps
as the tensor's memory (zero-copy; it lands in fresh memory once). A larger tensor arrives in
smaller pieces received straight into a preallocated tensor (``recv_into``); the pieces are small
enough for the allocator to reuse their buffers. Every tensor is checked against its manifest
checksum before it is handed out.

A receiver that fetches version after version (a replica) passes a ``ReceiveBuffer``: every tensor then
arrives in pieces of at most 8 MiB received into that buffer, kept from one version to the next. Fresh
memory costs a page fault per 4 KiB on its first write: 0.42 GB took 0.35 s to touch on this VM against
0.02 s for memory written before (1.2 vs 20 GB/s), and a replica that received each version into fresh
memory spent that on every version (docs/benchmarks.md, "The CPU weight path, before and after").
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from types import TracebackType

import torch
import zmq

from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.manifest import Chunk, Manifest, decode_manifest, new_hasher, plan_chunks
from fleetrl.weights.protocol import PROTOCOL, RANGE, parse_error
from fleetrl.weights.timeouts import MIN_TRANSFER_RATE_BYTES_PER_S, transfer_timeout_s

# Receiver credit: at most this many bytes and chunks requested but not yet received. Whole-tensor
# chunks in flight cost no extra memory (they become the tensors); pieces of larger tensors are
# small enough (below glibc's 32 MiB mmap threshold) that their buffers are reused.
_WINDOW_BYTES = 256 << 20
_WINDOW_CHUNKS = 64
_SPLIT_BYTES = 8 << 20
_ALIGN = 64  # every tensor of a ReceiveBuffer starts on a 64-byte boundary: any dtype view of it is aligned


class ReceiveBuffer:
    """Host memory that versions are received into, reused from one fetch to the next.

    A fetch given this buffer (``fetch_weights(..., into=buffer)``) lays the version's tensors out in it and
    yields views of it, so they are valid only until the next fetch into the same buffer: the caller copies them
    where they belong (a replica's swap) before fetching again. The memory is reallocated only when a version's
    byte count changes (``allocations`` counts it) and given up by ``release()``.
    """

    def __init__(self) -> None:
        self.allocations = 0
        self._memory: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the buffer holds."""
        return 0 if self._memory is None else self._memory.numel()

    def release(self) -> None:
        """Drop the memory (views handed out keep their part alive until they go)."""
        self._memory = None

    def layout(self, manifest: Manifest) -> list[torch.Tensor]:
        """A flat uint8 view of the buffer for each tensor of `manifest`, in order (reallocated if the size differs)."""
        offsets, end = [], 0
        for spec in manifest.tensors:
            end = -(-end // _ALIGN) * _ALIGN
            offsets.append(end)
            end += spec.nbytes
        if self._memory is None or self._memory.numel() != end:
            self._memory = None  # released before the new one is allocated
            self._memory = torch.empty(end, dtype=torch.uint8)
            self.allocations += 1
        return [self._memory[o : o + s.nbytes] for o, s in zip(offsets, manifest.tensors, strict=True)]


class WeightStream(Iterator[tuple[str, torch.Tensor]]):
    """One fetch of one weight version, yielding ``(name, tensor)`` in manifest order.

    The manifest is fetched (and checked) when the stream is created, so ``manifest`` is available
    before the first tensor. Each tensor is yielded only after all its bytes arrived and, with
    ``verify``, its checksum matched; a mismatch raises WeightTransferError instead. ``timeout_s``
    bounds every wait for the publisher. ``deadline`` (a ``time.monotonic()`` value) optionally
    bounds the whole fetch; so does ``budget_floor_s``: the fetch then gets that plus its bytes at
    ``rate_bytes_per_s`` from its start (fleetrl.weights.timeouts), known once the manifest arrived.
    Close it (or use ``with``) if you stop early.
    """

    def __init__(
        self,
        address: str,
        version: int,
        *,
        timeout_s: float = 120.0,
        auth_token: str | None = None,
        verify: bool = True,
        deadline: float | None = None,
        budget_floor_s: float | None = None,
        rate_bytes_per_s: float = MIN_TRANSFER_RATE_BYTES_PER_S,
        into: ReceiveBuffer | None = None,
    ) -> None:
        started = time.monotonic()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"weight version must be a non-negative int, got {version!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.address = address
        self.version = version
        self.verify = verify
        self._timeout_s = float(timeout_s)
        self._deadline = deadline
        if budget_floor_s is not None:  # the manifest must arrive within the floor, the rest within the budget
            transfer_timeout_s(budget_floor_s, 0, rate_bytes_per_s)  # ValueError now for a bad floor or rate
            self._deadline = _earliest(deadline, started + budget_floor_s)
        self._session_id: bytes | None = None
        self._closed = False
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 1000)  # lets the final "done" reach the publisher
        self._socket.setsockopt(zmq.SNDTIMEO, max(1, int(self._timeout_s * 1000)))
        try:
            self._socket.connect(address)
            self.manifest, self._chunk_bytes = self._request_manifest(auth_token)
            if budget_floor_s is not None:
                budget_s = transfer_timeout_s(budget_floor_s, self.manifest.total_bytes, rate_bytes_per_s)
                self._deadline = _earliest(deadline, started + budget_s)
        except zmq.ZMQError as exc:
            self.close()
            raise WeightTransferError(f"cannot fetch weights from {address!r}: {exc}", reason="connect") from exc
        except BaseException:
            self.close()
            raise
        self._targets = None if into is None else into.layout(self.manifest)
        self._chunks = self._plan_chunks()
        self._next_request = 0
        self._in_flight_chunks = 0
        self._in_flight_bytes = 0
        self._tensors = self._receive_tensors()

    @property
    def deadline(self) -> float | None:
        """When the whole fetch fails (a ``time.monotonic()`` value; None: only each wait is bounded)."""
        return self._deadline

    def __iter__(self) -> WeightStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._closed:
            raise StopIteration
        try:
            return next(self._tensors)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Tell the publisher this fetch is over and release the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._session_id is not None:
            # Best effort: the publisher also expires idle sessions.
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart([PROTOCOL, b"done", self._session_id], zmq.NOBLOCK)
        self._socket.close()

    def __enter__(self) -> WeightStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"weight version {self.version} from {self.address}"

    def _wait(self, what: str) -> None:
        timeout = self._timeout_s
        if self._deadline is not None:
            timeout = min(timeout, self._deadline - time.monotonic())
        if timeout <= 0 or not self._socket.poll(int(timeout * 1000) + 1, zmq.POLLIN):
            raise WeightTransferError(
                f"timed out waiting for {what} of {self._where()} (no reply within "
                f"{max(timeout, 0):.1f}s; is the publisher running and reachable?)",
                reason="timeout",
            )

    def _raise_error_reply(self, payload: bytes) -> None:
        reason, message = parse_error(payload)
        raise WeightTransferError(f"weight publisher at {self.address} refused the fetch: {message}", reason=reason)

    def _request_manifest(self, auth_token: str | None) -> tuple[Manifest, int]:
        request = json.dumps({"version": self.version}).encode()
        try:
            self._socket.send_multipart([PROTOCOL, b"manifest", (auth_token or "").encode(), request])
        except zmq.Again:
            raise WeightTransferError(f"could not send the request for {self._where()}", reason="timeout") from None
        self._wait("the manifest")
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        if frames[0] == b"error" and len(frames) == 2:
            self._raise_error_reply(frames[1])
        if frames[0] != b"manifest" or len(frames) != 4:
            raise WeightTransferError(
                f"unexpected reply to the manifest request for {self._where()}", reason="protocol"
            )
        self._session_id = frames[1]
        try:
            chunk_bytes = json.loads(frames[2])["chunk_bytes"]
            if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
                raise ValueError(f"chunk_bytes {chunk_bytes!r}")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise WeightTransferError(f"bad transfer header for {self._where()}: {exc}", reason="protocol") from exc
        try:
            manifest = decode_manifest(frames[3])
        except RecursionError as exc:  # deeply nested JSON: as bad as any other malformed manifest
            raise WeightTransferError(f"bad weight manifest for {self._where()}: {exc}", reason="protocol") from exc
        if manifest.version != self.version:
            raise WeightTransferError(
                f"asked for {self._where()} but the publisher sent version {manifest.version}",
                reason="protocol",
            )
        return manifest, chunk_bytes

    def _plan_chunks(self) -> tuple[Chunk, ...]:
        """The chunks this fetch asks for (a relay hop asks for smaller ones to pipeline them)."""
        if self._targets is not None:  # every tensor in pieces received into the buffer: no fresh frame memory
            return plan_chunks(self.manifest, min(self._chunk_bytes, _SPLIT_BYTES))
        return plan_chunks(self.manifest, self._chunk_bytes, split_bytes=min(self._chunk_bytes, _SPLIT_BYTES))

    def _chunk_received(self, chunk: Chunk, data: memoryview) -> None:
        """Called with each chunk's bytes as they arrive, before the tensor is checked (a relay serves them on)."""

    @staticmethod
    def _range(chunk: Chunk) -> bytes:
        return RANGE.pack(chunk.tensor_index, chunk.start, chunk.stop)

    def _request_more(self) -> None:
        """Keep requests in flight within the credit window (always at least one)."""
        assert self._session_id is not None
        while self._next_request < len(self._chunks):
            chunk = self._chunks[self._next_request]
            if self._in_flight_chunks and (
                self._in_flight_chunks >= _WINDOW_CHUNKS or self._in_flight_bytes + chunk.nbytes > _WINDOW_BYTES
            ):
                return
            try:
                self._socket.send_multipart([PROTOCOL, b"chunk", self._session_id, self._range(chunk)])
            except zmq.Again:
                raise WeightTransferError(
                    f"could not request chunk {chunk.index} of {self._where()}", reason="timeout"
                ) from None
            self._next_request += 1
            self._in_flight_chunks += 1
            self._in_flight_bytes += chunk.nbytes

    def _receive_header(self, chunk: Chunk) -> str:
        """Wait for the reply to ``chunk`` and read up to its data frame; returns its description."""
        spec = self.manifest.tensors[chunk.tensor_index]
        what = f"chunk {chunk.index} (tensor {spec.name!r})"
        self._wait(what)
        sock = self._socket
        kind = sock.recv(zmq.NOBLOCK)
        if kind == b"error" and sock.rcvmore:
            self._raise_error_reply(sock.recv())
        if kind != b"chunk" or not sock.rcvmore:
            raise WeightTransferError(f"unexpected reply for {what} of {self._where()}", reason="protocol")
        if sock.recv() != self._range(chunk) or not sock.rcvmore:
            raise WeightTransferError(
                f"out-of-order or malformed reply for {what} of {self._where()}",
                reason="protocol",
            )
        self._in_flight_chunks -= 1
        self._in_flight_bytes -= chunk.nbytes
        return what

    def _check_size(self, what: str, received: int, expected: int) -> None:
        if received != expected or self._socket.rcvmore:
            raise WeightTransferError(
                f"incomplete transfer: {what} of {self._where()} carried {received} bytes, expected {expected}",
                reason="incomplete",
            )

    def _receive_into(self, chunk: Chunk, target: memoryview) -> None:
        """Receive ``chunk`` straight into ``target``, its slice of a preallocated tensor."""
        what = self._receive_header(chunk)
        self._check_size(what, self._socket.recv_into(target), len(target))

    def _receive_whole(self, chunk: Chunk, itemsize: int) -> torch.Tensor:
        """Receive a one-chunk tensor as uint8, keeping ZeroMQ's message as its memory.

        Zero-copy: the tensor owns the received frame (writable, freed with the tensor); only a
        frame whose address does not suit the dtype's alignment is copied.
        """
        what = self._receive_header(chunk)
        frame = self._socket.recv(copy=False)
        self._check_size(what, len(frame), chunk.nbytes)
        flat = torch.frombuffer(frame, dtype=torch.uint8)
        if flat.data_ptr() % itemsize:
            flat = flat.clone()
        return flat

    def _receive_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        chunks, next_chunk = self._chunks, 0
        for tensor_index, spec in enumerate(self.manifest.tensors):
            hasher = new_hasher() if self.verify else None
            mine = []
            while next_chunk < len(chunks) and chunks[next_chunk].tensor_index == tensor_index:
                mine.append(chunks[next_chunk])
                next_chunk += 1
            self._request_more()
            if len(mine) == 1 and self._targets is None:
                flat = self._receive_whole(mine[0], spec.torch_dtype.itemsize)
                self._chunk_received(mine[0], memoryview(flat.numpy()))
                # Ask for the next chunks before hashing so that the wire stays busy meanwhile.
                self._request_more()
                if hasher is not None:
                    hasher.update(memoryview(flat.numpy()))
            else:  # several chunks (or none), or a ReceiveBuffer: assemble in a preallocated tensor
                if self._targets is None:
                    flat = torch.empty(spec.nbytes, dtype=torch.uint8)
                else:
                    flat = self._targets[tensor_index]
                data = memoryview(flat.numpy())
                for chunk in mine:
                    self._request_more()
                    target = data[chunk.start : chunk.stop]
                    self._receive_into(chunk, target)
                    self._chunk_received(chunk, target)
                    self._request_more()
                    if hasher is not None:
                        hasher.update(target)
            if hasher is not None and hasher.hexdigest() != spec.checksum:
                raise WeightTransferError(
                    f"checksum mismatch for tensor {spec.name!r} of {self._where()}: received "
                    f"bytes hash to {hasher.hexdigest()}, the manifest says {spec.checksum}",
                    reason="checksum",
                )
            yield spec.name, flat.view(spec.torch_dtype).reshape(spec.shape)


def iter_weights(
    address: str,
    version: int,
    *,
    timeout_s: float = 120.0,
    auth_token: str | None = None,
    verify: bool = True,
    budget_floor_s: float | None = None,
) -> WeightStream:
    """Open a fetch of ``version``: ``.manifest`` at once, then ``(name, tensor)`` one by one.

    Raises WeightTransferError right away for an unknown version, a refused token or no reply
    within ``timeout_s``; while iterating, ``timeout_s`` bounds each wait for the publisher (time
    the caller spends between items does not count). ``budget_floor_s``: the whole fetch also
    fails after that plus its bytes at a conservative rate (fleetrl.weights.timeouts).
    """
    return WeightStream(
        address, version, timeout_s=timeout_s, auth_token=auth_token, verify=verify, budget_floor_s=budget_floor_s
    )


def fetch_weights(
    address: str,
    version: int,
    *,
    timeout_s: float = 120.0,
    auth_token: str | None = None,
    verify: bool = True,
    rate_bytes_per_s: float = MIN_TRANSFER_RATE_BYTES_PER_S,
    into: ReceiveBuffer | None = None,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Fetch all of ``version``; every tensor checked against the manifest. ``timeout_s`` bounds each
    wait for the publisher, and the whole fetch gets ``timeout_s`` plus its bytes at
    ``rate_bytes_per_s`` (fleetrl.weights.timeouts: a conservative 100 MB/s by default). ``into``: receive
    into that reused buffer (the tensors are views of it, valid until the next fetch into it)."""
    with WeightStream(
        address,
        version,
        timeout_s=timeout_s,
        auth_token=auth_token,
        verify=verify,
        budget_floor_s=timeout_s,
        rate_bytes_per_s=rate_bytes_per_s,
        into=into,
    ) as stream:
        tensors = dict(stream)
        return stream.manifest, tensors


def _earliest(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)
