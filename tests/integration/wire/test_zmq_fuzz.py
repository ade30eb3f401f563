"""Adversarial input to the two ZeroMQ endpoints a run exposes (the trainer's group receiver and weight publisher),
over real sockets on loopback with auth on: garbage, truncated and oversize frames, deep nesting, wrong types, wrong
or missing tokens, too many frames. Each input is dropped (and counted), answered with an error, or makes ZeroMQ
disconnect its sender; after each one the endpoint still serves a well-formed request."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from fleetrl.group_stream import GroupReceiver, GroupSender, encode_group
from fleetrl.rollout import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.v1 import controller_pb2, rollout_pb2
from fleetrl.weights import WeightPublisher, fetch_weights
from fleetrl.weights.protocol import PROTOCOL, RANGE
from fleetrl.weights.publisher import MAX_REQUEST_BYTES

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
T = TOKEN.encode()
GROUP_CAP = 1 << 20  # the receiver's max_message_bytes in these tests


def _wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _wait_disconnected(monitor: zmq.Socket, timeout_s: float = 15.0) -> None:
    """Wait for the peer to drop our connection (what ZeroMQ does to a sender of an oversize frame)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0 and monitor.poll(left_ms), "the oversize sender was not disconnected"
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return


# -- the group receiver ----------------------------------------------------------------------------------------


def _sample(**kw) -> RolloutSample:
    values = {"tokens": [5, 6, 7], "logprobs": [0.0, -0.5, -1.0], "loss_mask": [0, 1, 1], "reward": 1.0}
    return RolloutSample(**{**values, **kw})


def _payload(row_id: int = 900) -> bytes:
    return encode_group(RolloutGroup(row_id, 0, [_sample(), _sample(reward=0.0)]))[1]


def _bad_values_payload() -> bytes:
    msg = rollout_pb2.RolloutGroup(row_id=2**63 - 1, submit_version=-(2**63), attempt=-1)
    msg.samples.add(tokens=[1, -5], logprobs=[0.0, 0.0], loss_mask=[0, 1], reward=float("nan"))
    msg.samples.add(tokens=[1, 2], logprobs=[0.0], loss_mask=[0, 1], reward=1e308)
    msg.samples.add(tokens=[1, 2], logprobs=[0.0, float("inf")], loss_mask=[0, 7], reward=1.0)
    msg.samples.add(tokens=[1], logprobs=[0.0], loss_mask=[1], reward=1.0, metrics={"m": float("nan")})
    return msg.SerializeToString()


def _invalid_utf8_payload() -> bytes:
    return rollout_pb2.RolloutGroup(source="x").SerializeToString()[:-1] + b"\xff"


# (name, frames, expected): "malformed" / "auth" = dropped and counted under that reason, "disconnect" = ZeroMQ
# drops the sender (frame over max_message_bytes), "samples" = a group whose every sample is dropped as invalid,
# "group" = parses (with the right token) into a group handed over.
GROUP_INPUTS: list[tuple[str, list[bytes], str]] = [
    ("garbage, one frame", [b"\xff\xff not a protobuf"], "malformed"),
    ("empty frame", [b""], "malformed"),
    ("the old one-frame format", [_payload()], "malformed"),
    ("garbage payload", [T, b"\xff\xff\xff\xff garbage"], "malformed"),
    ("truncated protobuf", [T, _payload()[:-5]], "malformed"),
    ("one byte of protobuf", [T, _payload()[:1]], "malformed"),
    ("deeply nested protobuf groups", [T, b"{" * 100_000], "malformed"),
    ("deeply nested JSON", [T, b"[" * 100_000], "malformed"),
    ("invalid UTF-8 in a string field", [T, _invalid_utf8_payload()], "malformed"),
    ("three frames", [T, _payload(), b"extra"], "malformed"),
    ("1000 frames", [T] * 1000, "malformed"),
    ("no token", [b"", _payload()], "auth"),
    ("wrong token", [b"wrong", _payload()], "auth"),
    ("token with a NUL appended", [T + b"\x00", _payload()], "auth"),
    ("100 kB token", [b"\xff" * 100_000, _payload()], "auth"),
    ("900 kB unauthenticated payload", [b"wrong", b"\x0a" * 900_000], "auth"),
    ("oversize payload", [T, b"\x00" * (GROUP_CAP + 1)], "disconnect"),
    ("oversize token frame", [b"x" * (GROUP_CAP + 1), _payload()], "disconnect"),
    (
        "another message type",
        [T, controller_pb2.LeaseRowsRequest(gateway_id="g", max_rows=3).SerializeToString()],
        "group",
    ),
    ("NaN/inf/huge values, bad lengths, negative ids", [T, _bad_values_payload()], "samples"),
]


class _Inbox:
    def __init__(self) -> None:
        self.row_ids: list[int] = []
        self.lock = threading.Lock()

    def add(self, group: RolloutGroup) -> None:
        with self.lock:
            self.row_ids.append(group.row_id)

    def has(self, row_id: int) -> bool:
        with self.lock:
            return row_id in self.row_ids


def test_group_receiver_survives_every_adversarial_message_and_keeps_receiving():
    inbox = _Inbox()
    receiver = GroupReceiver(inbox.add, auth_token=TOKEN, max_message_bytes=GROUP_CAP).start()
    context = zmq.Context.instance()
    try:
        assert receiver._socket.getsockopt(zmq.MAXMSGSIZE) == GROUP_CAP
        with GroupSender(receiver.address, auth_token=TOKEN) as good:
            for i, (name, frames, expected) in enumerate(GROUP_INPUTS):
                before = receiver.snapshot_counts()
                raw = context.socket(zmq.PUSH)
                raw.setsockopt(zmq.LINGER, 0)
                monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED) if expected == "disconnect" else None
                raw.connect(receiver.address)
                try:
                    raw.send_multipart(frames)
                    if monitor is not None:
                        _wait_disconnected(monitor)
                    else:
                        key = {
                            "malformed": "messages_dropped/malformed",
                            "auth": "messages_dropped/auth",
                            "group": "groups",
                            "samples": "groups",
                        }[expected]
                        _wait_until(lambda k=key, b=before: receiver.snapshot_counts().get(k, 0) > b.get(k, 0), name)
                finally:
                    if monitor is not None:
                        raw.disable_monitor()
                        monitor.close(linger=0)
                    raw.close(linger=0)
                after = receiver.snapshot_counts()
                if expected == "samples":
                    assert after["samples_dropped"] - before.get("samples_dropped", 0) == 4, name
                if expected in ("malformed", "auth", "disconnect"):
                    assert after.get("groups", 0) == before.get("groups", 0), f"{name} was handed over"
                # The stream still works: a well-formed group arrives.
                good.send(RolloutGroup(1000 + i, 0, [_sample()]))
                _wait_until(lambda row=1000 + i: inbox.has(row), f"the good group after {name!r}")
                receiver.check()
    finally:
        receiver.stop()
    assert not inbox.has(900)  # no payload of a dropped message was ever handed over


# -- the weight publisher --------------------------------------------------------------------------------------

SESSION = b"<session>"  # replaced by a real session id opened by the test's own authenticated fetch


def _manifest_request(token: bytes, body: bytes | object) -> list[bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return [PROTOCOL, b"manifest", token, data]


# (name, frames, expected, sent_by_the_session_owner): expected is the error reason of the reply, "no_reply"
# (a done, silently ignored) or "disconnect" (a frame over MAX_REQUEST_BYTES).
PUBLISHER_INPUTS: list[tuple[str, list[bytes], str, bool]] = [
    ("empty frame", [b""], "protocol", False),
    ("garbage", [b"\xff\xfe garbage"], "protocol", False),
    ("pickle", [b"pickle", b"\x80\x04\x95"], "protocol", False),
    ("protocol only", [PROTOCOL], "protocol", False),
    ("manifest without arguments", [PROTOCOL, b"manifest"], "protocol", False),
    ("the old manifest format (token in the JSON)", [PROTOCOL, b"manifest", b'{"version": 1}'], "protocol", False),
    ("no token", _manifest_request(b"", {"version": 1}), "auth", False),
    ("wrong token", _manifest_request(b"wrong", {"version": 1}), "auth", False),
    ("5 kB token", _manifest_request(b"\xff" * 5000, {"version": 1}), "auth", False),
    ("deep JSON without a token (not parsed)", _manifest_request(b"", b"[" * 60_000), "auth", False),
    ("deeply nested JSON list", _manifest_request(T, b"[" * 60_000), "protocol", False),
    ("deeply nested JSON object", _manifest_request(T, b'{"a":' * 10_000), "protocol", False),
    ("oversize deep JSON", _manifest_request(T, b"[" * 100_000), "disconnect", False),
    ("oversize deep JSON without a token", _manifest_request(b"", b"[" * 100_000), "disconnect", False),
    ("not JSON", _manifest_request(T, b"{not json"), "protocol", False),
    ("invalid UTF-8", _manifest_request(T, b"\xff\xfe\xfd"), "protocol", False),
    ("version a string", _manifest_request(T, {"version": "1"}), "protocol", False),
    ("version a float", _manifest_request(T, {"version": 1.0}), "protocol", False),
    ("version a bool", _manifest_request(T, {"version": True}), "protocol", False),
    ("version null", _manifest_request(T, {"version": None}), "protocol", False),
    ("version NaN", _manifest_request(T, b'{"version": NaN}'), "protocol", False),
    ("no version", _manifest_request(T, {"versions": 1}), "protocol", False),
    ("a JSON list", _manifest_request(T, [1]), "protocol", False),
    ("a JSON string", _manifest_request(T, "1"), "protocol", False),
    ("a JSON number", _manifest_request(T, 1), "protocol", False),
    ("negative version", _manifest_request(T, {"version": -1}), "unknown_version", False),
    ("huge version", _manifest_request(T, {"version": 2**70}), "unknown_version", False),
    ("unpublished version", _manifest_request(T, {"version": 99}), "unknown_version", False),
    ("manifest with an extra frame", [*_manifest_request(T, {"version": 1}), b"extra"], "protocol", False),
    ("20 frames", [PROTOCOL] * 20, "protocol", False),
    ("10000 frames", [PROTOCOL, b"chunk"] + [b"x"] * 9998, "protocol", False),
    ("a 60 kB request name", [PROTOCOL, b"x" * 60_000], "protocol", False),
    ("unknown request", [PROTOCOL, b"frobnicate"], "protocol", False),
    ("chunk without arguments", [PROTOCOL, b"chunk"], "protocol", False),
    ("chunk with a short range", [PROTOCOL, b"chunk", b"x" * 16, b"short"], "protocol", False),
    ("chunk of an unknown session", [PROTOCOL, b"chunk", b"x" * 16, RANGE.pack(0, 0, 8)], "unknown_session", False),
    ("chunk of another peer's session", [PROTOCOL, b"chunk", SESSION, RANGE.pack(0, 0, 8)], "unknown_session", False),
    (
        "chunk of a tensor that does not exist",
        [PROTOCOL, b"chunk", SESSION, RANGE.pack(2**32 - 1, 0, 1)],
        "protocol",
        True,
    ),
    ("chunk with start > stop", [PROTOCOL, b"chunk", SESSION, RANGE.pack(0, 8, 4)], "protocol", True),
    ("chunk past the end", [PROTOCOL, b"chunk", SESSION, RANGE.pack(0, 0, 2**64 - 1)], "protocol", True),
    ("done without a session", [PROTOCOL, b"done"], "no_reply", False),
    ("done of another peer's session", [PROTOCOL, b"done", SESSION], "no_reply", False),
    ("done with two sessions", [PROTOCOL, b"done", b"a", b"b"], "no_reply", False),
    ("oversize frame", [b"x" * (MAX_REQUEST_BYTES + 1)], "disconnect", False),
]


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 16, generator=gen), "b": torch.arange(10, dtype=torch.int64)}


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 15_000)
    sock.connect(address)
    return sock


def test_weight_publisher_survives_every_adversarial_request_and_keeps_serving():
    sd = _state_dict()
    with WeightPublisher(chunk_bytes=4096, auth_token=TOKEN) as pub:
        pub.publish(1, sd)
        owner = _dealer(pub.address)
        try:
            owner.send_multipart(_manifest_request(T, {"version": 1}))
            kind, session, _, _ = owner.recv_multipart()
            assert kind == b"manifest"
            for name, template, expected, by_owner in PUBLISHER_INPUTS:
                frames = [session if f == SESSION else f for f in template]
                requests_before = pub.snapshot_counts().get("requests", 0)
                sock = owner if by_owner else _dealer(pub.address)
                monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if expected == "disconnect" else None
                try:
                    sock.send_multipart(frames)
                    if expected == "disconnect":
                        _wait_disconnected(monitor)
                    elif expected == "no_reply":
                        _wait_until(lambda b=requests_before: pub.snapshot_counts()["requests"] > b, name)
                        assert not sock.poll(0), f"{name} was answered"
                    else:
                        reply = sock.recv_multipart()
                        assert reply[0] == b"error", f"{name}: {reply[:1]}"
                        assert json.loads(reply[1])["reason"] == expected, f"{name}: {reply[1][:300]!r}"
                finally:
                    if monitor is not None:
                        sock.disable_monitor()
                        monitor.close(linger=0)
                    if sock is not owner:
                        sock.close(linger=0)
                # The publisher still serves: a whole authenticated fetch, bit-exact.
                _, got = fetch_weights(pub.address, 1, timeout_s=15, auth_token=TOKEN)
                assert all(torch.equal(got[k], sd[k]) for k in sd), name
            # Another peer's "done" did not close the owner's session.
            owner.send_multipart([PROTOCOL, b"chunk", session, RANGE.pack(1, 0, 8)])
            kind, _, data = owner.recv_multipart()
            assert kind == b"chunk" and data == sd["b"].numpy().tobytes()[:8]
        finally:
            owner.close(linger=0)
        counts = pub.snapshot_counts()
    assert counts.get("requests_refused/internal", 0) == 0  # every input took a handled path
