"""`WeightStreamServer`: the serving end of the weight stream protocol, shared by the publisher and the relay.

One ZeroMQ ROUTER socket, served by one background thread, answers any number of concurrent fetches
(``fleetrl.weights.fetch``) following ``fleetrl.weights.protocol``: a manifest request opens a fetch session, chunk
requests ask for byte ranges of its tensors, "done" closes it. What a version is and how a chunk is answered is
the subclass's: ``WeightPublisher`` serves published snapshots at once, ``WeightRelay`` serves one version as it
arrives from upstream (answering a range when its bytes are there). Everything else is here, once:

- Requests come from anyone who can reach the port, so none may stop the serving loop: a request frame over
  ``MAX_REQUEST_BYTES`` makes ZeroMQ disconnect its peer, the token frame is compared before any JSON is parsed,
  and whatever goes wrong with one request is answered with an error (or, if even that cannot be sent, dropped
  with a warning) and counted in ``counts``.
- A reply to a peer that has gone (or whose queue is full) is dropped, and so are its sessions.
- Sessions idle past ``session_timeout_s`` expire (looked for every ``session_sweep_s``); at most
  ``MAX_SESSIONS`` are open at once.
- ``counts``: "requests", "requests_refused/<reason>", "sessions_expired", "collective_offers", and what the
  subclass adds.
- A "collective" request asks for the version's group of the collective transport (``fleetrl.weights.collective``);
  a subclass that can broadcast (the publisher) answers it in ``_open_collective``, the relay refuses it.

A subclass implements ``_open_session(version)`` (the manifest to serve, a ``Refusal``, or ``Deferred``: the
manifest request waits, retried every turn of the loop, for a version still being staged) and
``_answer_chunk(...)``; it may poll a file descriptor beside the socket (``_wake_fd``, ``_on_wake``), act on each
turn of the loop (``_on_tick``), forget a peer's own state (``_forget_peer``) and release its own resources when
the loop ends (``_serve_finished``).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from secrets import token_bytes
from typing import Any

import zmq

from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.manifest import Manifest
from fleetrl.weights.protocol import PROTOCOL, RANGE, SESSION_ID_BYTES, error_frames

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 << 10  # per frame (ZMQ_MAXMSGSIZE); requests are a few hundred bytes
MAX_SESSIONS = 1024
_POLL_MS = 100
_MAX_REQUEST_FRAMES = 8  # the longest request has 4 frames (after the peer identity)
_MAX_TOKEN_BYTES = 4096
_BATCH = 256  # requests handled per wake-up at most, so that stop, ticks and expiry still run under load


class Deferred(Exception):
    """Raised by ``_open_session``: the version is on its way (the publisher is staging it); the manifest request
    is answered once ``_open_session`` serves it, retried on every turn of the loop."""


class Refusal(Exception):
    """Raised by ``_open_session``: the fetch is refused with this reason (an error reply, counted)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class Session:
    """One fetch: its peer, the manifest it was served and what the subclass keeps for it."""

    peer: bytes
    manifest: Manifest
    source: Any = None  # the publisher's snapshot; unused by the relay
    last_seen: float = field(default_factory=time.monotonic)


class WeightStreamServer:
    """The serving loop of the weight stream (see the module docstring); subclasses say what it serves."""

    name = "weight server"  # in logs and errors: "weight publisher", "weight relay"

    def __init__(
        self,
        *,
        auth_token: str | None,
        session_timeout_s: float,
        session_sweep_s: float,
    ) -> None:
        if auth_token is not None and (not isinstance(auth_token, str) or not auth_token):
            raise ValueError("auth_token must be a non-empty string or None")
        if not session_timeout_s > 0:
            raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s!r}")
        if not session_sweep_s > 0:
            raise ValueError(f"session_sweep_s must be positive, got {session_sweep_s!r}")
        self.address = ""
        self.chunk_bytes = 0  # the largest range a chunk request may ask for; set before serving starts
        self.counts: Counter[str] = Counter()  # written by the serving thread only
        self._auth_token = auth_token.encode() if auth_token is not None else None
        self._session_timeout_s = session_timeout_s
        self._session_sweep_s = session_sweep_s
        self._sessions: dict[bytes, Session] = {}  # serving thread only
        # manifest (and collective) requests waiting for their version (serving thread): peer, args, since, handler
        self._deferred: list[tuple[bytes, list[bytes], float, Any]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._serve_failure: BaseException | None = None
        self._context: zmq.Context | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def _start_serving(self, bind: str, start_timeout_s: float, thread_name: str) -> None:
        """Bind ``bind`` and serve in a background thread; WeightTransferError (reason "publisher") if it cannot
        bind within ``start_timeout_s``."""
        self._context = zmq.Context(io_threads=1)
        self._thread = threading.Thread(target=self._serve, args=(bind,), name=thread_name, daemon=True)
        self._thread.start()
        if self._ready.wait(start_timeout_s) and self._serve_failure is None:
            return
        self._stop.set()
        self._thread.join(start_timeout_s)
        if not self._thread.is_alive():
            self._context.term()
        failure = self._serve_failure
        raise WeightTransferError(
            f"{self.name} cannot bind {bind!r}: {failure or f'not bound within {start_timeout_s}s'}",
            reason="publisher",
        ) from failure

    def _stop_serving(self, timeout_s: float) -> None:
        """Stop the loop and release the socket; raises if it does not stop or had failed."""
        self._stop.set()
        assert self._thread is not None and self._context is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WeightTransferError(f"{self.name} loop did not stop within {timeout_s}s", reason="publisher")
        self._context.term()

    def _raise_if_failed(self) -> None:
        if self._serve_failure is not None:
            raise WeightTransferError(
                f"{self.name} serving loop failed: {self._serve_failure!r}", reason="publisher"
            ) from self._serve_failure

    # -- what a subclass provides -------------------------------------------------------------

    def _open_session(self, version: int) -> tuple[Manifest, bytes, Any]:
        """The manifest of ``version``, encoded, and what the session keeps; raise Refusal to refuse."""
        raise NotImplementedError

    def _answer_chunk(
        self, sock: zmq.Socket, peer: bytes, session: Session, header: bytes, tensor_index: int, start: int, stop: int
    ) -> None:
        """Answer a valid chunk request (``header`` is its range frame, sent back with the bytes)."""
        raise NotImplementedError

    def _wake_fd(self) -> int | None:
        """A file descriptor polled beside the socket (readable: ``_on_wake``); None: only the socket."""
        return None

    def _on_wake(self) -> None:
        """The wake file descriptor became readable."""

    def _on_tick(self, sock: zmq.Socket, now: float) -> None:
        """Called once per turn of the loop (at least every 100 ms)."""

    def _forget_peer(self, peer: bytes) -> None:
        """A peer's session ended (done, expired, unreachable): drop whatever the subclass keeps for it."""

    def _serve_finished(self) -> None:
        """The loop ended (or never bound): release the subclass's own resources."""

    def _open_collective(
        self, version: int, replicas: int, timeout_s: float, device: str = "cpu"
    ) -> tuple[bytes, bytes]:
        """The reply frames (offer JSON, manifest) for the collective push of ``version`` to ``replicas`` replicas,
        the asking one on ``device`` (``fleetrl.weights.collective``); raise Refusal (the default: this server only
        streams) or Deferred."""
        raise Refusal("unsupported", f"the {self.name} does not serve collective pushes")

    # -- the loop -----------------------------------------------------------------------------

    def _serve(self, bind: str) -> None:
        assert self._context is not None
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer is an error, not a drop
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            sock.bind(bind)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._serve_failure = exc
            self._serve_finished()
            self._ready.set()
            return
        self.address = endpoint.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        wake = self._wake_fd()
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        next_sweep = time.monotonic() + self._session_sweep_s
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if wake is not None and wake in events:
                    self._on_wake()
                if sock in events:
                    for _ in range(_BATCH):
                        try:
                            frames = _receive(sock)
                        except zmq.Again:
                            break
                        self._handle_safely(sock, frames)
                now = time.monotonic()
                if self._deferred:
                    self._retry_deferred(sock, now)
                self._on_tick(sock, now)
                if now >= next_sweep:
                    self._expire_sessions(now)
                    next_sweep = now + self._session_sweep_s
        except BaseException as exc:
            logger.exception("%s serving loop failed", self.name)
            self._serve_failure = exc
        finally:
            self._sessions.clear()
            self._deferred.clear()
            sock.close(linger=0)
            self._serve_finished()

    def _handle_safely(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """Handle one request; nothing a peer sends may stop the loop: a failure is logged, counted, answered."""
        try:
            self._handle(sock, frames)
        except zmq.ContextTerminated:
            raise
        except Exception as exc:
            logger.warning("%s: a request failed (%d frames): %r", self.name, len(frames), exc)
            self._refuse(sock, frames[0], "internal", f"the request failed: {type(exc).__name__}")

    def _refuse(self, sock: zmq.Socket, peer: bytes, reason: str, message: str) -> None:
        self.counts[f"requests_refused/{reason}"] += 1
        try:
            self._send(sock, peer, error_frames(reason, message))
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:  # an unroutable or odd peer: its reply is dropped
            logger.warning("%s: could not answer a refused request: %s", self.name, exc)

    def _send(self, sock: zmq.Socket, peer: bytes, frames: list[Any]) -> bool:
        """Send a reply; False (the peer's sessions dropped) when the peer is gone or its queue is full."""
        try:
            sock.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            logger.warning("%s: dropping a reply to a receiver: %s", self.name, exc)
            self._drop_peer(peer)
            return False
        return True

    def _drop_peer(self, peer: bytes) -> None:
        for session_id in [s for s, v in self._sessions.items() if v.peer == peer]:
            del self._sessions[session_id]
        self._forget_peer(peer)

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
        elif op == b"collective":
            self._serve_collective(sock, peer, args)
        elif op == b"done":
            session = self._sessions.get(args[0]) if len(args) == 1 else None
            if session is not None and session.peer == peer:
                del self._sessions[args[0]]
                self._forget_peer(peer)
        else:
            self._refuse(sock, peer, "protocol", f"unknown request {op[:64]!r}")

    def _token_ok(self, token: bytes) -> bool:
        if self._auth_token is None:
            return True
        return len(token) <= _MAX_TOKEN_BYTES and hmac.compare_digest(token, self._auth_token)

    def _retry_deferred(self, sock: zmq.Socket, now: float) -> None:
        """Answer the manifest requests whose version has become servable; drop those waiting past the session
        timeout (their fetches gave up long before)."""
        waiting, self._deferred = self._deferred, []
        for peer, args, since, handler in waiting:
            if now - since > self._session_timeout_s:
                self._refuse(sock, peer, "timeout", f"the {self.name} did not have the version within the timeout")
                continue
            try:
                handler(sock, peer, args, since=since)
            except zmq.ContextTerminated:
                raise
            except Exception as exc:  # as _handle_safely: one request never stops the loop
                logger.warning("%s: a deferred request failed: %r", self.name, exc)
                self._refuse(sock, peer, "internal", f"the request failed: {type(exc).__name__}")

    def _serve_manifest(self, sock: zmq.Socket, peer: bytes, args: list[bytes], since: float | None = None) -> None:
        if len(args) != 2:
            self._refuse(sock, peer, "protocol", "bad manifest request: expected [token, JSON request] frames")
            return
        token, request_json = args
        if not self._token_ok(token):  # before parsing anything the peer sent
            what = "a wrong auth token" if token else "no auth token"
            logger.warning("%s: refused a fetch with %s", self.name, what)
            self._refuse(sock, peer, "auth", f"the {self.name} requires an auth token and the fetch sent {what}")
            return
        try:
            version = json.loads(request_json)["version"]
            if not isinstance(version, int) or isinstance(version, bool):
                raise TypeError("version is not an int")
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            self._refuse(sock, peer, "protocol", f"bad manifest request: {str(exc)[:200]}")
            return
        try:
            manifest, manifest_bytes, source = self._open_session(version)
        except Refusal as refusal:
            self._refuse(sock, peer, refusal.reason, refusal.message)
            return
        except Deferred:
            if since is None and len(self._deferred) >= MAX_SESSIONS:
                self._refuse(sock, peer, "busy", f"the {self.name} has {MAX_SESSIONS} fetches waiting; try again later")
                return
            if since is None:
                self.counts["manifests_deferred"] += 1
            self._deferred.append((peer, args, time.monotonic() if since is None else since, self._serve_manifest))
            return
        if len(self._sessions) >= MAX_SESSIONS:
            self._refuse(sock, peer, "busy", f"the {self.name} has {MAX_SESSIONS} fetches open; try again later")
            return
        session_id = token_bytes(SESSION_ID_BYTES)
        self._sessions[session_id] = Session(peer, manifest, source)
        transfer = json.dumps({"chunk_bytes": self.chunk_bytes}).encode()
        if self._send(sock, peer, [b"manifest", session_id, transfer, manifest_bytes]):
            self.counts["manifests_served"] += 1
            logger.debug("%s: serving version %d to a receiver", self.name, version)

    def _serve_collective(self, sock: zmq.Socket, peer: bytes, args: list[bytes], since: float | None = None) -> None:
        """A replica asks for the group of a version (``fleetrl.weights.collective.request_group``)."""
        if len(args) != 2:
            self._refuse(sock, peer, "protocol", "bad collective request: expected [token, JSON request] frames")
            return
        token, request_json = args
        if not self._token_ok(token):
            what = "a wrong auth token" if token else "no auth token"
            self._refuse(sock, peer, "auth", f"the {self.name} requires an auth token and the request sent {what}")
            return
        try:
            request = json.loads(request_json)
            version, replicas, timeout_s = request["version"], request["replicas"], float(request["timeout_s"])
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (version, replicas)) or replicas < 1:
                raise TypeError("version and replicas must be ints, replicas >= 1")
            if not 0 < timeout_s < 1e6:
                raise ValueError(f"timeout_s {timeout_s} out of range")
            device = request.get("device", "cpu")  # the replica's device ("cpu" or "cuda"); older replicas omit it
            if device not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)[:20]!r}")
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            self._refuse(sock, peer, "protocol", f"bad collective request: {str(exc)[:200]}")
            return
        try:
            offer, manifest_bytes = self._open_collective(version, replicas, timeout_s, device)
        except Refusal as refusal:
            self._refuse(sock, peer, refusal.reason, refusal.message)
            return
        except Deferred:
            if since is None and len(self._deferred) >= MAX_SESSIONS:
                message = f"the {self.name} has {MAX_SESSIONS} requests waiting; try again later"
                self._refuse(sock, peer, "busy", message)
                return
            self._deferred.append((peer, args, time.monotonic() if since is None else since, self._serve_collective))
            return
        if self._send(sock, peer, [b"collective", offer, manifest_bytes]):
            self.counts["collective_offers"] += 1

    def _serve_chunk(self, sock: zmq.Socket, peer: bytes, args: list[bytes]) -> None:
        if len(args) != 2 or len(args[1]) != RANGE.size:
            self._refuse(sock, peer, "protocol", "bad chunk request")
            return
        session = self._sessions.get(args[0])
        if session is None or session.peer != peer:
            self._refuse(sock, peer, "unknown_session", "unknown or expired fetch session (ask for the manifest again)")
            return
        tensor_index, start, stop = RANGE.unpack(args[1])
        tensors = session.manifest.tensors
        if not (
            tensor_index < len(tensors)
            and start < stop <= tensors[tensor_index].nbytes
            and stop - start <= self.chunk_bytes
        ):
            self._refuse(sock, peer, "protocol", f"bad chunk request: tensor {tensor_index} bytes [{start}, {stop})")
            return
        session.last_seen = time.monotonic()
        self._answer_chunk(sock, peer, session, args[1], tensor_index, start, stop)

    def _expire_sessions(self, now: float) -> None:
        expired = [s for s, v in self._sessions.items() if now - v.last_seen > self._session_timeout_s]
        for session_id in expired:
            logger.info("%s: dropping a fetch session idle for too long", self.name)
            peer = self._sessions.pop(session_id).peer
            self._forget_peer(peer)
            self.counts["sessions_expired"] += 1


def _receive(sock: zmq.Socket) -> list[bytes]:
    """One request's frames (peer identity first); past ``_MAX_REQUEST_FRAMES`` + 1 they are let go."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(copy=False)
        if len(frames) <= _MAX_REQUEST_FRAMES + 1:  # the identity, the limit, one more to tell "too many"
            frames.append(frame.bytes)
    return frames
