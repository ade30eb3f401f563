"""The publishing end of the weight stream: ``WeightPublisher`` serves state dicts over ZeroMQ.

The trainer calls ``publish(version, state_dict)``; a background thread answers any number of
concurrent fetches (``fleetrl.weights.fetch``) following ``fleetrl.weights.protocol``. Tensor bytes
are sent as memoryviews of the published snapshot with ``copy=False``.

Requests come from anyone who can reach the port, so none may stop the serving loop: a request frame
over ``MAX_REQUEST_BYTES`` makes ZeroMQ disconnect its peer, the token frame is compared before any
JSON is parsed, and whatever goes wrong with one request is answered with an error (or dropped) and
counted in ``counts``.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from secrets import token_bytes
from types import TracebackType
from typing import Any

import torch
import zmq

from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.manifest import Manifest, dtype_name, encode_manifest, spec_for_tensor, tensor_bytes
from fleetrl.weights.protocol import PROTOCOL, RANGE, SESSION_ID_BYTES, error_frames

logger = logging.getLogger(__name__)

_POLL_MS = 100
_MAX_SESSIONS = 1024
MAX_REQUEST_BYTES = 64 << 10  # per frame (ZMQ_MAXMSGSIZE); requests are a few hundred bytes
_MAX_REQUEST_FRAMES = 8  # the longest request has 4 frames (after the peer identity)
_MAX_TOKEN_BYTES = 4096


@dataclass
class _Snapshot:
    """A published version as served: its manifest (also encoded) and the bytes of each tensor."""

    manifest: Manifest
    manifest_bytes: bytes
    payloads: tuple[memoryview, ...]  # raw bytes of each tensor, views of `tensors`
    tensors: tuple[torch.Tensor, ...]


@dataclass
class _Session:
    snapshot: _Snapshot
    peer: bytes
    last_seen: float = field(default_factory=time.monotonic)


class WeightPublisher:
    """Serves the latest published weight versions to any number of concurrent receivers.

    ``publish`` snapshots a state dict (a contiguous CPU copy, so the trainer may keep updating
    its parameters) and makes it fetchable; the newest ``keep_versions`` versions stay available.
    The serving loop runs in a background thread; if it fails, the failure is logged and raised
    as WeightTransferError by the next ``publish`` or ``close``. With ``auth_token`` set, a fetch
    without that token is refused. ``counts`` (``snapshot_counts()``): "requests" handled,
    "manifests_served" (fetches begun), "bytes_served" (tensor bytes sent),
    "requests_refused/<reason>" (protocol, auth, unknown_version, unknown_session, busy, internal)
    and "sessions_expired" (fetch sessions idle past ``session_timeout_s``, looked for every
    ``session_sweep_s``).
    """

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
    ) -> None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if not isinstance(keep_versions, int) or keep_versions < 1:
            raise ValueError(f"keep_versions must be an int >= 1, got {keep_versions!r}")
        if auth_token is not None and (not isinstance(auth_token, str) or not auth_token):
            raise ValueError("auth_token must be a non-empty string or None")
        if session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s!r}")
        if session_sweep_s <= 0:
            raise ValueError(f"session_sweep_s must be positive, got {session_sweep_s!r}")
        self.chunk_bytes = chunk_bytes
        self.keep_versions = keep_versions
        self._bind = bind
        self._auth_token = auth_token.encode() if auth_token is not None else None
        self._session_timeout_s = session_timeout_s
        self._session_sweep_s = session_sweep_s
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, _Snapshot] = OrderedDict()  # guarded by _lock
        self._sessions: dict[bytes, _Session] = {}  # serving thread only
        self._latest: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        self.counts: Counter[str] = Counter()  # written by the serving thread only
        self.address = ""
        self._context = zmq.Context(io_threads=1)
        self._thread = threading.Thread(target=self._serve, name="fleetrl-weight-publisher", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            self._stop.set()
            raise WeightTransferError(
                f"weight publisher did not bind {bind!r} within {start_timeout_s}s",
                reason="publisher",
            )
        if self._failure is not None:
            self._thread.join(start_timeout_s)
            self._context.term()
            self._closed = True
            raise WeightTransferError(
                f"weight publisher cannot bind {bind!r}: {self._failure}", reason="publisher"
            ) from self._failure

    # -- public API ---------------------------------------------------------------------------

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions a new fetch can get, oldest first."""
        with self._lock:
            return tuple(self._versions)

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
    ) -> Manifest:
        """Snapshot ``state_dict`` as ``version`` (greater than any published before) and serve it.

        ``adapter``: for a LoRA run, the PEFT adapter config; ``state_dict`` then holds only the
        adapter's tensors (see ``Manifest.adapter``). ``float_dtype``: floating tensors are cast to it in
        the snapshot copy (the dtype the replicas serve; None keeps each tensor's own).
        """
        self._check_usable()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"weight version must be a non-negative int, got {version!r}")
        if self._latest is not None and version <= self._latest:
            raise ValueError(f"weight version {version} is not newer than the last published {self._latest}")
        started = time.perf_counter()
        snapshot = self._snapshot(version, state_dict, adapter, float_dtype)
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"weight version {version} is not newer than the last published {self._latest}")
            self._versions[version] = snapshot
            self._latest = version
            while len(self._versions) > self.keep_versions:
                self._versions.popitem(last=False)
        manifest = snapshot.manifest
        logger.info(
            "published weights version %d: %d tensors, %.1f MB, checksum %s, in %.2fs",
            version,
            len(manifest.tensors),
            manifest.total_bytes / 1e6,
            manifest.checksum,
            time.perf_counter() - started,
        )
        return manifest

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and release the socket; raises if the serving loop had failed."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightTransferError(f"weight publisher loop did not stop within {timeout_s}s", reason="publisher")
        self._context.term()
        with self._lock:
            self._versions.clear()
        if self._failure is not None:
            raise WeightTransferError(
                f"weight publisher serving loop failed: {self._failure!r}", reason="publisher"
            ) from self._failure

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

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WeightTransferError(
                f"weight publisher serving loop failed: {self._failure!r}", reason="publisher"
            ) from self._failure
        if self._closed:
            raise WeightTransferError("weight publisher is closed", reason="publisher")

    def _snapshot(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        adapter: Mapping[str, Any] | None = None,
        float_dtype: torch.dtype | None = None,
    ) -> _Snapshot:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        for name, tensor in state_dict.items():
            if not isinstance(name, str):
                raise TypeError(f"state dict keys must be strings, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is a {type(tensor).__name__}")
            if tensor.layout != torch.strided:
                raise ValueError(f"tensor {name!r} has layout {tensor.layout}; only dense travels")
            try:
                dtype_name(tensor.dtype)
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None
        if float_dtype is not None:
            dtype_name(float_dtype)  # one that can travel
            if not float_dtype.is_floating_point:
                raise ValueError(f"float_dtype must be a floating dtype, got {float_dtype}")
        tensors: list[torch.Tensor] = []
        for tensor in state_dict.values():
            # One copy from any device straight into fresh contiguous CPU memory (cast on the way if asked).
            dtype = float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype
            copy = torch.empty(tuple(tensor.shape), dtype=dtype, device="cpu")
            copy.copy_(tensor.detach())
            tensors.append(copy)
        manifest = Manifest.build(
            version,
            tuple(spec_for_tensor(n, t) for n, t in zip(state_dict, tensors, strict=True)),
            adapter,
        )
        return _Snapshot(
            manifest=manifest,
            manifest_bytes=encode_manifest(manifest),
            payloads=tuple(tensor_bytes(t) for t in tensors),
            tensors=tuple(tensors),
        )

    def _serve(self) -> None:
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not a drop
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            sock.bind(self._bind)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._failure = exc
            self._ready.set()
            return
        self.address = endpoint.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
        self._ready.set()
        next_expiry = time.monotonic() + self._session_sweep_s
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    # Drain a bounded batch so that stop and expiry checks still run under load.
                    for _ in range(256):
                        try:
                            frames = self._receive(sock)
                        except zmq.Again:
                            break
                        self._handle_safely(sock, frames)
                now = time.monotonic()
                if now >= next_expiry:
                    self._expire_sessions(now)
                    next_expiry = now + self._session_sweep_s
        except BaseException as exc:
            logger.exception("weight publisher serving loop failed")
            self._failure = exc
        finally:
            self._sessions.clear()
            sock.close(linger=0)

    @staticmethod
    def _receive(sock: zmq.Socket) -> list[bytes]:
        """One request's frames (peer identity first); past ``_MAX_REQUEST_FRAMES`` + 1 they are let go."""
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [frame.bytes]
        while frame.more:
            frame = sock.recv(copy=False)
            if len(frames) <= _MAX_REQUEST_FRAMES + 1:  # the identity, the limit, one more to tell "too many"
                frames.append(frame.bytes)
        return frames

    def _handle_safely(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """Handle one request; nothing a peer sends may stop the loop: a failure is logged, counted, answered."""
        try:
            self._handle(sock, frames)
        except zmq.ContextTerminated:
            raise
        except Exception as exc:
            logger.warning("weight publisher: a request failed (%d frames): %r", len(frames), exc)
            self._refuse(sock, frames[0], "internal", f"the request failed: {type(exc).__name__}")

    def _refuse(self, sock: zmq.Socket, peer: bytes, reason: str, message: str) -> None:
        self.counts[f"requests_refused/{reason}"] += 1
        try:
            self._send(sock, peer, error_frames(reason, message))
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:  # an unroutable or odd peer: its reply is dropped
            logger.warning("weight publisher: could not answer a refused request: %s", exc)

    def _send(self, sock: zmq.Socket, peer: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            logger.warning("weight publisher: dropping reply to a receiver: %s", exc)
            for session_id in [s for s, v in self._sessions.items() if v.peer == peer]:
                del self._sessions[session_id]
            return False
        return True

    def _handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        self.counts["requests"] += 1
        if len(body) < 2 or len(body) > _MAX_REQUEST_FRAMES or body[0] != PROTOCOL:
            self._refuse(sock, peer, "protocol", f"expected {PROTOCOL!r} requests")
            return
        op, args = body[1], body[2:]
        if op == b"chunk":
            self._serve_chunk(sock, peer, args)
        elif op == b"manifest":
            self._serve_manifest(sock, peer, args)
        elif op == b"done":
            session = self._sessions.get(args[0]) if len(args) == 1 else None
            if session is not None and session.peer == peer:
                del self._sessions[args[0]]
        else:
            self._refuse(sock, peer, "protocol", f"unknown request {op[:64]!r}")

    def _token_ok(self, token: bytes) -> bool:
        if self._auth_token is None:
            return True
        return len(token) <= _MAX_TOKEN_BYTES and hmac.compare_digest(token, self._auth_token)

    def _serve_manifest(self, sock: zmq.Socket, peer: bytes, args: list[bytes]) -> None:
        if len(args) != 2:
            self._refuse(sock, peer, "protocol", "bad manifest request: expected [token, JSON request] frames")
            return
        token, request_json = args
        if not self._token_ok(token):  # before parsing anything the peer sent
            what = "a wrong auth token" if token else "no auth token"
            logger.warning("weight publisher: refused a fetch with %s", what)
            message = f"the weight publisher requires an auth token and the fetch sent {what}"
            self._refuse(sock, peer, "auth", message)
            return
        try:
            request = json.loads(request_json)
            version = request["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise TypeError("version is not an int")
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            self._refuse(sock, peer, "protocol", f"bad manifest request: {str(exc)[:200]}")
            return
        with self._lock:
            snapshot = self._versions.get(version)
            available = list(self._versions)
        if snapshot is None:
            message = f"weight version {version} is not available; the publisher has {available}"
            self._refuse(sock, peer, "unknown_version", message)
            return
        if len(self._sessions) >= _MAX_SESSIONS:
            message = f"the weight publisher has {_MAX_SESSIONS} fetches open; try again later"
            self._refuse(sock, peer, "busy", message)
            return
        session_id = token_bytes(SESSION_ID_BYTES)
        self._sessions[session_id] = _Session(snapshot, peer)
        transfer = json.dumps({"chunk_bytes": self.chunk_bytes}).encode()
        self._send(sock, peer, [b"manifest", session_id, transfer, snapshot.manifest_bytes])
        self.counts["manifests_served"] += 1
        logger.debug("weight publisher: serving version %d to a receiver", version)

    def _serve_chunk(self, sock: zmq.Socket, peer: bytes, args: list[bytes]) -> None:
        if len(args) != 2 or len(args[1]) != RANGE.size:
            self._refuse(sock, peer, "protocol", "bad chunk request")
            return
        session = self._sessions.get(args[0])
        if session is None or session.peer != peer:
            message = "unknown or expired fetch session (ask for the manifest again)"
            self._refuse(sock, peer, "unknown_session", message)
            return
        tensor_index, start, stop = RANGE.unpack(args[1])
        tensors = session.snapshot.manifest.tensors
        if not (
            tensor_index < len(tensors)
            and start < stop <= tensors[tensor_index].nbytes
            and stop - start <= self.chunk_bytes
        ):
            message = f"bad chunk request: tensor {tensor_index} bytes [{start}, {stop})"
            self._refuse(sock, peer, "protocol", message)
            return
        session.last_seen = time.monotonic()
        payload = self._chunk_payload(session.snapshot, tensor_index, start, stop)
        self._send(sock, peer, [b"chunk", args[1], payload])
        self.counts["bytes_served"] += stop - start

    def _expire_sessions(self, now: float) -> None:
        expired = [s for s, v in self._sessions.items() if now - v.last_seen > self._session_timeout_s]
        for session_id in expired:
            logger.info("weight publisher: dropping a fetch session idle for too long")
            del self._sessions[session_id]
            self.counts["sessions_expired"] += 1
