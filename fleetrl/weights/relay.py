"""A relay hop of the weight stream: ``WeightRelay`` fetches one version and serves it on at once.

A replica that holds (or is receiving) a version re-serves it to its peers, so the trainer sends one
copy however many replicas there are (``relay_plan.plan_relay`` says who fetches from whom). A relay
speaks the publisher's wire protocol (``fleetrl.weights.protocol``), so an unchanged
``fetch_weights`` or another relay can fetch from it:

- it fetches the manifest from its upstream first, then binds and serves that manifest at once;
- its upstream fetch asks for chunks of at most ``chunk_bytes`` (a tensor larger than that travels in
  pieces), and each piece is served on as soon as it has arrived (pipelined: a downstream hop is a
  piece behind, not a whole push behind); it advertises that chunk size, so downstream fetches ask
  for the very ranges it receives and they are sent without a copy;
- a request for a range that has not arrived yet is answered when it arrives, or with the upstream
  fetch's failure (it fails after ``timeout_s`` without progress; a request still waiting after twice
  that gets a timeout reply of its own);
- every tensor is checked against its manifest checksum at every hop: the local consumer
  (``iter_weights`` / ``wait``, the engine) gets ``(name, tensor)`` only once it matched;
- an upstream failure (a checksum mismatch, an upstream that stops answering) is answered to every
  downstream request from then on with an error reply carrying the upstream's reason, so it surfaces
  as WeightTransferError at every hop below, each within its own timeout.

Tensors handed to the local consumer share memory with what the relay serves: treat them as read
only (loading them into an engine copies them). A relay holds one version; close it when no peer
needs that version any more.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import zmq

from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.fetch import WeightStream
from fleetrl.weights.manifest import Chunk, Manifest, encode_manifest, plan_chunks
from fleetrl.weights.server import Refusal, Session, WeightStreamServer

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20  # a hop's pipelining grain: ~34 ms at 1 Gbit/s
_MAX_PENDING = 8192  # chunk requests waiting for their bytes, all peers together


class _UpstreamFetch(WeightStream):
    """The relay's fetch from its upstream: asks for ``chunk_bytes`` pieces and reports each arrival."""

    def __init__(
        self,
        address: str,
        version: int,
        *,
        chunk_bytes: int,
        on_chunk: Callable[[Chunk, memoryview], None],
        timeout_s: float,
        auth_token: str | None,
    ) -> None:
        self._relay_chunk_bytes = chunk_bytes
        self._on_chunk = on_chunk
        self.served_chunk_bytes = chunk_bytes
        super().__init__(address, version, timeout_s=timeout_s, auth_token=auth_token, verify=True)

    def _plan_chunks(self) -> tuple[Chunk, ...]:
        self.served_chunk_bytes = min(self._chunk_bytes, self._relay_chunk_bytes)
        return plan_chunks(self.manifest, self.served_chunk_bytes, split_bytes=self.served_chunk_bytes)

    def _chunk_received(self, chunk: Chunk, data: memoryview) -> None:
        self._on_chunk(chunk, data)


@dataclass
class _Pending:
    """A downstream chunk request whose bytes have not all arrived yet."""

    header: bytes
    tensor_index: int
    start: int
    stop: int
    since: float


class WeightRelay(WeightStreamServer):
    """Fetches ``version`` from ``upstream_address`` and serves it on ``bind`` while it arrives.

    The constructor fetches the manifest (WeightTransferError if the upstream refuses or does not
    answer within ``timeout_s``), binds, and returns with the fetch under way in a background
    thread; ``address`` is where downstream hops fetch from. ``auth_token`` is sent upstream and
    required from downstream fetches. ``timeout_s`` bounds each wait for the upstream: the fetch
    fails after that long without progress, and that failure answers every downstream request and
    local consumer waiting for bytes; one still waiting after twice that long without upstream
    progress (a backstop) gets a timeout of its own.

    ``counts`` (written by the serving thread): "requests", "manifests_served", "chunks_served",
    "chunks_deferred" (answered later, when their bytes arrived), "requests_refused/<reason>",
    "sessions_expired". The serving loop is the publisher's (``fleetrl.weights.server``).
    """

    name = "weight relay"

    def __init__(
        self,
        upstream_address: str,
        version: int,
        *,
        auth_token: str | None = None,
        bind: str = "tcp://127.0.0.1:0",
        timeout_s: float = 120.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        session_timeout_s: float = 300.0,
        start_timeout_s: float = 10.0,
    ) -> None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        super().__init__(auth_token=auth_token, session_timeout_s=session_timeout_s, session_sweep_s=1.0)
        self.upstream_address = upstream_address
        self.version = version
        self.timeout_s = float(timeout_s)
        # Shared between the upstream thread, the serving thread and consumers; guarded by _cond.
        self._cond = threading.Condition()
        self._verified: list[tuple[str, torch.Tensor]] = []
        self._finished = False
        self._failure: WeightTransferError | None = None
        self._closed = False
        self._last_progress = time.monotonic()
        self._pending: dict[bytes, deque[_Pending]] = {}  # serving thread only
        self._pending_count = 0
        # Fetch the manifest first (raises at once for a refusal), then serve it.
        self._upstream = _UpstreamFetch(
            upstream_address,
            version,
            chunk_bytes=chunk_bytes,
            on_chunk=self._on_chunk,
            timeout_s=self.timeout_s,
            auth_token=auth_token,
        )
        self.manifest: Manifest = self._upstream.manifest
        self.chunk_bytes = self._upstream.served_chunk_bytes
        self._manifest_bytes = encode_manifest(self.manifest)
        self._pieces: list[list[tuple[int, int, memoryview]]] = [[] for _ in self.manifest.tensors]
        self._piece_starts: list[list[int]] = [[] for _ in self.manifest.tensors]
        self._arrived = [0] * len(self.manifest.tensors)  # bytes of each tensor received, in order
        # Wake-ups from the upstream thread to the serving loop: a pipe the loop polls with its socket.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._fetch_thread = threading.Thread(target=self._fetch, name="fleetrl-weight-relay-fetch", daemon=True)
        try:
            self._start_serving(bind, start_timeout_s, "fleetrl-weight-relay")
        except WeightTransferError:
            self._upstream.close()
            os.close(self._wake_write)
            self._closed = True
            raise
        self._fetch_thread.start()

    # -- the local consumer -------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once every tensor arrived and matched its checksum."""
        with self._cond:
            return self._finished

    @property
    def error(self) -> WeightTransferError | None:
        """Why the upstream fetch failed, if it did."""
        with self._cond:
            return self._failure

    def iter_weights(self, *, timeout_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in manifest order, each once its checksum matched at this hop.

        Any number of consumers may iterate, at any time (a late one gets the tensors already held
        at once). Raises WeightTransferError when the upstream fetch failed or nothing arrived for
        ``timeout_s`` (default: twice the relay's, a backstop behind the upstream fetch's own).
        """
        wait_s = 2 * self.timeout_s if timeout_s is None else timeout_s
        index = 0
        while True:
            item = self._next_verified(index, wait_s, None)
            if item is None:
                return
            index += 1
            yield item

    def wait(self, timeout_s: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The whole version, as ``fetch_weights`` gives it; ``timeout_s`` bounds the whole wait."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        tensors: dict[str, torch.Tensor] = {}
        while (item := self._next_verified(len(tensors), 2 * self.timeout_s, deadline)) is not None:
            tensors[item[0]] = item[1]
        return self.manifest, tensors

    def _next_verified(self, index: int, wait_s: float, deadline: float | None) -> tuple[str, torch.Tensor] | None:
        with self._cond:
            while True:
                if self._closed:
                    raise WeightTransferError(f"weight relay for version {self.version} is closed", reason="closed")
                if index < len(self._verified):
                    return self._verified[index]
                if self._failure is not None:
                    raise WeightTransferError(str(self._failure), reason=self._failure.reason) from self._failure
                if self._finished:
                    return None
                now = time.monotonic()
                left = self._last_progress + wait_s - now
                if deadline is not None:
                    left = min(left, deadline - now)
                if left <= 0:
                    raise WeightTransferError(
                        f"timed out waiting for weight version {self.version} relayed from "
                        f"{self.upstream_address} (nothing arrived within {wait_s:.1f}s)",
                        reason="timeout",
                    )
                self._cond.wait(left)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and release the version; raises if the serving loop had failed.

        An upstream fetch still under way stops at its next tensor (or its next timeout).
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop_serving(timeout_s)
        # The fetch thread uses no socket of this context; one still waiting upstream ends by itself
        # at its next tensor or timeout.
        self._fetch_thread.join(min(timeout_s, 1.0))
        with self._cond:
            self._verified.clear()
            self._pieces = [[] for _ in self.manifest.tensors]
        self._raise_if_failed()

    def __enter__(self) -> WeightRelay:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the upstream fetch (its own thread) --------------------------------------------------

    def _fetch(self) -> None:
        try:
            for name, tensor in self._upstream:
                with self._cond:
                    self._verified.append((name, tensor))
                    self._last_progress = time.monotonic()
                    self._cond.notify_all()
                if self._stop.is_set():
                    raise WeightTransferError("weight relay closed during its fetch", reason="closed")
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            logger.info(
                "weight relay: version %d (%.1f MB) arrived from %s and checked",
                self.version,
                self.manifest.total_bytes / 1e6,
                self.upstream_address,
            )
        except BaseException as exc:
            failure = (
                exc
                if isinstance(exc, WeightTransferError)
                else WeightTransferError(f"weight relay fetch failed: {exc!r}", reason="upstream")
            )
            if failure.reason != "closed":
                logger.warning(
                    "weight relay: fetching version %d from %s failed: %s", self.version, self.upstream_address, exc
                )
            with self._cond:
                self._failure = failure
                self._cond.notify_all()
        finally:
            self._upstream.close()
            self._wake()
            os.close(self._wake_write)

    def _on_chunk(self, chunk: Chunk, data: memoryview) -> None:
        """A piece arrived upstream (before its tensor is checked): make it servable."""
        with self._cond:
            self._pieces[chunk.tensor_index].append((chunk.start, chunk.stop, data))
            self._piece_starts[chunk.tensor_index].append(chunk.start)
            self._arrived[chunk.tensor_index] = chunk.stop
            self._last_progress = time.monotonic()
            self._cond.notify_all()
        self._wake()

    def _wake(self) -> None:
        # A full pipe: the loop is awake anyway; a closed one (the relay was closed): nobody to wake.
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"!")

    # -- serving (its own thread) -------------------------------------------------------------

    def _range_bytes(self, tensor_index: int, start: int, stop: int) -> Any:
        """The bytes ``[start, stop)`` of a tensor if they have all arrived, else None."""
        with self._cond:
            if self._arrived[tensor_index] < stop:
                return None
            pieces = self._pieces[tensor_index]
            first = bisect.bisect_right(self._piece_starts[tensor_index], start) - 1
            piece_start, piece_stop, data = pieces[first]
            if stop <= piece_stop:  # the usual case: the very range that arrived, or part of it
                return data[start - piece_start : stop - piece_start]
            parts = []
            for piece_start, piece_stop, data in pieces[first:]:
                if piece_start >= stop:
                    break
                parts.append(data[max(start, piece_start) - piece_start : min(stop, piece_stop) - piece_start])
            return b"".join(parts)

    def _wake_fd(self) -> int | None:
        return self._wake_read

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass

    def _on_tick(self, sock: zmq.Socket, now: float) -> None:
        for peer in list(self._pending):
            self._flush(sock, peer, now, deferred=True)

    def _forget_peer(self, peer: bytes) -> None:
        self._pending_count -= len(self._pending.pop(peer, ()))

    def _serve_finished(self) -> None:
        self._pending.clear()
        os.close(self._wake_read)

    def _upstream_failure(self) -> WeightTransferError | None:
        with self._cond:
            return self._failure

    def _refuse_failed(self, sock: zmq.Socket, peer: bytes, failure: WeightTransferError) -> None:
        message = f"weight relay at {self.address} lost its upstream {self.upstream_address}: {failure}"
        self._refuse(sock, peer, failure.reason, message)

    def _open_session(self, version: int) -> tuple[Manifest, bytes, Any]:
        if version != self.version:
            message = f"weight version {version} is not available; the relay has [{self.version}]"
            raise Refusal("unknown_version", message)
        failure = self._upstream_failure()
        if failure is not None:
            message = f"weight relay at {self.address} lost its upstream {self.upstream_address}: {failure}"
            raise Refusal(failure.reason, message)
        return self.manifest, self._manifest_bytes, None

    def _answer_chunk(
        self, sock: zmq.Socket, peer: bytes, session: Session, header: bytes, tensor_index: int, start: int, stop: int
    ) -> None:
        if self._pending_count >= _MAX_PENDING:
            self._refuse(sock, peer, "busy", "the weight relay has too many chunk requests waiting; try again later")
            return
        now = time.monotonic()
        # Replies go out in request order: behind any request of this peer still waiting.
        self._pending.setdefault(peer, deque()).append(_Pending(header, tensor_index, start, stop, now))
        self._pending_count += 1
        self._flush(sock, peer, now, deferred=False)

    def _flush(self, sock: zmq.Socket, peer: bytes, now: float, *, deferred: bool) -> None:
        """Answer this peer's waiting requests, in order, as far as their bytes have arrived."""
        queue = self._pending.get(peer)
        while queue:
            request = queue[0]
            payload = self._range_bytes(request.tensor_index, request.start, request.stop)
            if payload is None:
                failure = self._upstream_failure()
                if failure is not None:
                    self._drop_peer(peer)
                    self._refuse_failed(sock, peer, failure)
                    return
                with self._cond:
                    last_progress = self._last_progress
                # A backstop: the upstream fetch itself fails after timeout_s without progress, and
                # that failure (with its reason) is what waiting requests are normally answered with.
                if now - max(request.since, last_progress) > 2 * self.timeout_s:
                    self._drop_peer(peer)
                    message = (
                        f"weight relay at {self.address}: bytes [{request.start}, {request.stop}) of tensor "
                        f"{request.tensor_index} did not arrive from {self.upstream_address} "
                        f"within {2 * self.timeout_s:.1f}s"
                    )
                    self._refuse(sock, peer, "timeout", message)
                return
            queue.popleft()
            self._pending_count -= 1
            if deferred:
                self.counts["chunks_deferred"] += 1
            self.counts["chunks_served"] += 1
            if not self._send(sock, peer, [b"chunk", request.header, payload]):
                return
        self._pending.pop(peer, None)
