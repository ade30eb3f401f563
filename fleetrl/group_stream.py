"""The rollout-group stream: gateways PUSH `fleetrl.v1.RolloutGroup` protobufs, the trainer PULLs them.

    receiver = GroupReceiver(on_group=buffer.add, bind="tcp://127.0.0.1:0")   # trainer side
    receiver.start(); print(receiver.address)
    with GroupSender(receiver.address) as sender:                              # gateway side
        sender.send(group)

One ZeroMQ message = two frames: [auth token (empty when auth is off), serialized RolloutGroup] (no pickle
anywhere). The receiver compares the token frame before it touches the payload, so an unauthenticated message
costs no parsing; ZeroMQ disconnects a peer whose frame exceeds `max_message_bytes`. On arrival every sample is
validated with `fleetrl.rollout.validate_sample`; invalid samples are dropped and counted (by field), never fatal.
A message with the wrong frames or token, or that does not parse, is dropped and counted as a whole.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType

import zmq

from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup, split_valid
from fleetrl.rpc import resolve_auth_token
from fleetrl.v1 import rollout_pb2

logger = logging.getLogger(__name__)

_POLL_MS = 100
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
MESSAGE_FRAMES = 2  # [auth token, RolloutGroup]
_MAX_TOKEN_BYTES = 4096  # a longer token frame is refused without being compared


class GroupStreamError(RuntimeError):
    """The stream cannot deliver (send timed out, socket closed, receiver loop failed)."""


class GroupDecodeError(ValueError):
    """A message that is not a RolloutGroup we accept; `reason` is a short counter tag."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def group_to_proto(group: RolloutGroup) -> rollout_pb2.RolloutGroup:
    msg = rollout_pb2.RolloutGroup(
        row_id=group.row_id,
        submit_version=group.submit_version,
        source=group.source,
        attempt=group.attempt,
        lease_tag=group.lease_tag,
    )
    for s in group.samples:
        sample = msg.samples.add(reward=float(s.reward), finish_reason=s.finish_reason or "", text=s.text or "")
        sample.tokens.extend(s.tokens)
        sample.logprobs.extend(s.logprobs)
        sample.loss_mask.extend(s.loss_mask)
        if s.versions is not None:
            sample.versions.extend(s.versions)
        for key, value in s.metrics.items():
            sample.metrics[key] = float(value)
        if s.member is not None:
            sample.member = int(s.member)
        if s.turn_rewards is not None:
            sample.turn_rewards.extend(float(r) for r in s.turn_rewards)
        if s.turn_ends is not None:
            sample.turn_ends.extend(s.turn_ends)
    return msg


def group_from_proto(msg: rollout_pb2.RolloutGroup) -> RolloutGroup:
    """The domain group (samples not yet validated). An empty `versions` list means unknown, empty `turn_rewards`
    and `turn_ends` none (a group from a sender older than those fields reads the same)."""
    samples = [
        RolloutSample(
            tokens=list(s.tokens),
            logprobs=list(s.logprobs),
            loss_mask=list(s.loss_mask),
            reward=s.reward,
            finish_reason=s.finish_reason or "stop",
            text=s.text,
            versions=list(s.versions) if len(s.versions) else None,
            metrics=dict(s.metrics),
            member=s.member if s.HasField("member") else None,
            turn_rewards=list(s.turn_rewards) if len(s.turn_rewards) else None,
            turn_ends=list(s.turn_ends) if len(s.turn_ends) else None,
        )
        for s in msg.samples
    ]
    return RolloutGroup(
        msg.row_id, msg.submit_version, samples, source=msg.source, attempt=msg.attempt, lease_tag=msg.lease_tag
    )


def encode_group(group: RolloutGroup, auth_token: str | None = None) -> list[bytes]:
    """The frames of one message: [auth token (empty: auth off), serialized RolloutGroup]."""
    return [(auth_token or "").encode(), group_to_proto(group).SerializeToString()]


def check_token(frame: bytes | zmq.Frame, auth_token: str | None) -> None:
    """Raise GroupDecodeError("auth") unless the token frame matches; compared before any parsing."""
    if auth_token is None:
        return
    if len(frame) <= _MAX_TOKEN_BYTES and hmac.compare_digest(bytes(frame), auth_token.encode()):
        return
    what = "no auth token" if not len(frame) else "a wrong auth token"
    raise GroupDecodeError(f"message carries {what} (set FLEETRL_AUTH_TOKEN on the sender)", "auth")


def decode_group(frames: Sequence[bytes | zmq.Frame], auth_token: str | None = None) -> RolloutGroup:
    """Check the frames and the token, then parse and validate: a group holding only its valid samples.

    Raises GroupDecodeError (reason "malformed" or "auth") for a message that is dropped as a whole.
    """
    if len(frames) != MESSAGE_FRAMES:
        got = len(frames) if len(frames) < MESSAGE_FRAMES else "more"
        raise GroupDecodeError(f"expected {MESSAGE_FRAMES} frames [token, RolloutGroup], got {got}", "malformed")
    check_token(frames[0], auth_token)
    payload = frames[1]
    data = payload.buffer if isinstance(payload, zmq.Frame) else payload
    msg = rollout_pb2.RolloutGroup()
    try:
        msg.ParseFromString(data)
        group = group_from_proto(msg)
    except Exception as exc:  # protobuf raises its own DecodeError subclasses (and worse on hostile input): drop
        raise GroupDecodeError(f"not a RolloutGroup protobuf ({len(data)} bytes): {exc!r}", "malformed") from None
    return split_valid(group)


class GroupSender:
    """PUSH side (a gateway). `send` blocks at most `send_timeout_s` when the trainer is not draining."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        send_timeout_s: float = 30.0,
        high_water_mark: int = 1000,
    ) -> None:
        self.address = address
        self._auth_token = resolve_auth_token(auth_token)
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.setsockopt(zmq.LINGER, 5000)
        # Queue only on a live connection: with no trainer listening, send() times out (and says so)
        # instead of piling groups into a pipe that may never drain.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)
        self._send_timeout_s = send_timeout_s

    def send(self, group: RolloutGroup) -> None:
        try:
            self._socket.send_multipart(encode_group(group, self._auth_token), copy=False)
        except zmq.Again:
            raise GroupStreamError(
                f"sending group of row {group.row_id} to {self.address} timed out after "
                f"{self._send_timeout_s}s (is the trainer running and receiving?)"
            ) from None

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class GroupReceiver:
    """PULL side (the trainer): a background thread decodes groups and hands them to `on_group`.

    Counters (`counts`): "groups" received and handed over, "samples" kept, "samples_dropped" and
    "samples_dropped/<field>" per invalid field, "messages_dropped/<reason>" (malformed, auth, handler).
    A frame over `max_message_bytes` never reaches it: ZeroMQ disconnects that peer (ZMQ_MAXMSGSIZE).
    `on_drop(reason, message)` is called for every drop. If the loop itself fails, `error` holds the
    exception and `check()` raises it.
    """

    def __init__(
        self,
        on_group: Callable[[RolloutGroup], object],
        *,
        bind: str = "tcp://127.0.0.1:0",
        auth_token: str | None = None,
        on_drop: Callable[[str, str], object] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        self._on_group = on_group
        self._on_drop = on_drop
        self._auth_token = resolve_auth_token(auth_token)
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise OSError(f"group stream cannot bind {bind!r}: {exc}") from exc
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> GroupReceiver:
        self._thread = threading.Thread(target=self._run, name="fleetrl-group-receiver", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise GroupStreamError if the receive loop has died."""
        if self.error is not None:
            raise GroupStreamError(f"group receiver failed: {self.error!r}") from self.error

    def snapshot_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _drop(self, reason: str, message: str) -> None:
        logger.warning("group stream: dropped (%s): %s", reason, message)
        if self._on_drop is not None:
            self._on_drop(reason, message)

    def handle_message(self, frames: Sequence[bytes | zmq.Frame]) -> RolloutGroup | None:
        """Check, decode, validate and hand over one message (the loop's body; also callable directly)."""
        try:
            group = decode_group(frames, self._auth_token)
        except GroupDecodeError as exc:
            self._count(f"messages_dropped/{exc.reason}")
            self._drop(exc.reason, str(exc))
            return None
        if group.dropped:
            self._count("samples_dropped", len(group.dropped))
            for dropped in group.dropped:
                self._count(f"samples_dropped/{dropped.field_name}")
                self._drop("invalid_sample", dropped.message)
        self._count("groups")
        self._count("samples", len(group.samples))
        self._on_group(group)
        return group

    def _receive(self) -> list[zmq.Frame]:
        """One message's frames without copying; past MESSAGE_FRAMES + 1 the rest are received and let go."""
        frame = self._socket.recv(copy=False)
        frames = [frame]
        while frame.more:
            frame = self._socket.recv(copy=False)
            if len(frames) <= MESSAGE_FRAMES:
                frames.append(frame)
        return frames

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                frames = self._receive()
                try:
                    self.handle_message(frames)
                except Exception as exc:  # a failing consumer must not kill the stream: count it
                    logger.exception("group stream: on_group handler failed")
                    self._count("messages_dropped/handler")
                    self._drop("handler", repr(exc))
        except Exception as exc:  # surfaced through `error` / check(); the owner decides what to do
            logger.exception("group receiver loop failed")
            self.error = exc
        finally:
            self._socket.close(linger=0)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise GroupStreamError(f"group receiver did not stop within {timeout_s}s")
        else:
            self._socket.close(linger=0)
