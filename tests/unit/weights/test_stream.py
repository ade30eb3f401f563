"""The weight stream end to end over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from fleetrl.weights import (
    WeightPublisher,
    WeightTransferError,
    build_manifest,
    fetch_weights,
    iter_weights,
)
from fleetrl.weights.manifest import tensor_bytes
from fleetrl.weights.protocol import PROTOCOL
from tests.waiting import wait_until

CHUNK = 4096  # small, so that several tensors span many chunks


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),
        "layer.0.attn.q.weight": torch.randn(3000, generator=gen).to(torch.bfloat16),  # 6000 B
        "layer.0.norm.weight": torch.randn(13, generator=gen).to(torch.bfloat16),
        "big": torch.randn(5, 1001, generator=gen),  # 20020 B > CHUNK, odd split
        "position_ids": torch.arange(257, dtype=torch.int64).reshape(1, 257),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(-1.5),
        "mask": torch.rand(9, generator=gen) > 0.5,
        "odd": torch.randn(3, 1, 5, generator=gen).transpose(0, 2),  # not contiguous
    }


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert bytes(tensor_bytes(got[name])) == bytes(tensor_bytes(tensor.contiguous())), name


@pytest.fixture
def publisher():
    with WeightPublisher(chunk_bytes=CHUNK) as pub:
        yield pub


def test_two_receivers_fetch_the_same_version_bit_exact_concurrently(publisher):
    sd = _state_dict()
    manifest = publisher.publish(3, sd)
    assert manifest == build_manifest(3, sd)
    assert publisher.address.startswith("tcp://127.0.0.1:")
    barrier = threading.Barrier(2)

    def receive() -> tuple[Any, dict[str, torch.Tensor]]:
        barrier.wait(timeout=10)
        return fetch_weights(publisher.address, 3, timeout_s=20)

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=30) for f in [pool.submit(receive), pool.submit(receive)]]
    for got_manifest, tensors in results:
        assert got_manifest == manifest
        _assert_bit_exact(tensors, sd)


def test_published_snapshot_is_independent_of_later_changes(publisher):
    sd = _state_dict()
    expected = {k: v.clone() for k, v in sd.items()}
    publisher.publish(1, sd)
    sd["big"].add_(1.0)  # the trainer keeps training after publishing
    _, got = fetch_weights(publisher.address, 1, timeout_s=10)
    _assert_bit_exact(got, expected)


def test_iter_weights_gives_the_manifest_first_then_tensors_in_order(publisher):
    sd = _state_dict()
    manifest = publisher.publish(1, sd)
    with iter_weights(publisher.address, 1, timeout_s=10) as stream:
        assert stream.manifest == manifest
        names = []
        for name, tensor in stream:
            names.append(name)
            assert torch.equal(tensor, sd[name])
    assert names == list(sd)


def test_stopping_a_stream_early_closes_it_cleanly(publisher):
    publisher.publish(1, _state_dict())
    with iter_weights(publisher.address, 1, timeout_s=10) as stream:
        name, _ = next(stream)
        assert name == "embed.weight"
    assert list(stream) == []  # closed
    _, got = fetch_weights(publisher.address, 1, timeout_s=10)  # the publisher is unaffected
    _assert_bit_exact(got, _state_dict())


class _CorruptingPublisher(WeightPublisher):
    """Flips one byte of tensor "big" as it goes on the wire (the stored snapshot stays intact)."""

    corrupt_tensor, corrupt_offset = "big", 10_001

    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        payload = super()._chunk_payload(snapshot, tensor_index, start, stop)
        name = snapshot.manifest.tensors[tensor_index].name
        if name == self.corrupt_tensor and start <= self.corrupt_offset < stop:
            corrupted = bytearray(payload)
            corrupted[self.corrupt_offset - start] ^= 0x10
            return corrupted
        return payload


@pytest.mark.parametrize(
    ("tensor", "offset"),
    [
        ("big", 10_001),  # larger than chunk_bytes: pieces received into a preallocated tensor
        ("embed.weight", 777),  # one whole chunk: the received message becomes the tensor
    ],
)
def test_a_corrupted_chunk_is_detected_by_the_receiver(tensor, offset):
    sd = _state_dict()
    with _CorruptingPublisher(chunk_bytes=CHUNK) as pub:
        pub.corrupt_tensor, pub.corrupt_offset = tensor, offset
        pub.publish(1, sd)
        with pytest.raises(WeightTransferError, match=f"checksum mismatch for tensor '{tensor}'") as info:
            fetch_weights(pub.address, 1, timeout_s=10)
        assert info.value.reason == "checksum"
        # The streaming variant yields every tensor before the corrupted one, then refuses it.
        seen = []
        with pytest.raises(WeightTransferError, match="checksum mismatch"):
            for name, _ in iter_weights(pub.address, 1, timeout_s=10):
                seen.append(name)
        assert seen == list(sd)[: list(sd).index(tensor)]
        # Without verification the same corruption arrives: exactly one byte differs.
        _, unverified = fetch_weights(pub.address, 1, timeout_s=10, verify=False)
        got, want = bytes(tensor_bytes(unverified[tensor])), bytes(tensor_bytes(sd[tensor]))
        assert [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b] == [offset]


class _TruncatingPublisher(WeightPublisher):
    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        payload = super()._chunk_payload(snapshot, tensor_index, start, stop)
        return payload[:-1] if snapshot.manifest.tensors[tensor_index].name == "big" else payload


def test_a_short_chunk_is_an_incomplete_transfer():
    with _TruncatingPublisher(chunk_bytes=CHUNK) as pub:
        pub.publish(1, _state_dict())
        with pytest.raises(WeightTransferError, match="incomplete transfer") as info:
            fetch_weights(pub.address, 1, timeout_s=10)
        assert info.value.reason == "incomplete"


def test_unknown_version_is_a_clear_error(publisher):
    publisher.publish(5, _state_dict())
    with pytest.raises(WeightTransferError, match=r"version 6 is not available.*\[5\]") as info:
        fetch_weights(publisher.address, 6, timeout_s=10)
    assert info.value.reason == "unknown_version"


def test_no_publisher_times_out_after_its_timeout(free_port):
    started = time.monotonic()
    with pytest.raises(WeightTransferError, match=r"timed out waiting for the manifest.*within 0\.5s") as info:
        fetch_weights(f"tcp://127.0.0.1:{free_port}", 1, timeout_s=0.5)
    assert info.value.reason == "timeout"
    # One-sided: it waited out its timeout (no upper bound, which a loaded machine could break;
    # a fetch that never gave up would hang and fail on pytest's timeout).
    assert time.monotonic() - started >= 0.4


def test_a_bad_address_is_a_clear_error():
    with pytest.raises(WeightTransferError, match="cannot fetch weights from 'nonsense'"):
        fetch_weights("nonsense", 1, timeout_s=1)


def test_auth_token_mismatch_is_refused():
    sd = _state_dict()
    with WeightPublisher(chunk_bytes=CHUNK, auth_token="s3cret") as pub:
        pub.publish(1, sd)
        for token in (None, "wrong"):
            with pytest.raises(WeightTransferError, match="requires an auth token") as info:
                fetch_weights(pub.address, 1, timeout_s=10, auth_token=token)
            assert info.value.reason == "auth"
            assert "s3cret" not in str(info.value)
        _, got = fetch_weights(pub.address, 1, timeout_s=10, auth_token="s3cret")
        _assert_bit_exact(got, sd)


def test_publishing_a_new_version_keeps_the_previous_one(publisher):
    v1, v2, v3 = _state_dict(1), _state_dict(2), _state_dict(3)
    publisher.publish(1, v1)
    publisher.publish(2, v2)
    assert publisher.versions == (1, 2)
    _assert_bit_exact(fetch_weights(publisher.address, 1, timeout_s=10)[1], v1)
    _assert_bit_exact(fetch_weights(publisher.address, 2, timeout_s=10)[1], v2)
    publisher.publish(3, v3)
    assert publisher.versions == (2, 3)
    with pytest.raises(WeightTransferError, match=r"version 1 is not available.*\[2, 3\]"):
        fetch_weights(publisher.address, 1, timeout_s=10)
    _assert_bit_exact(fetch_weights(publisher.address, 2, timeout_s=10)[1], v2)
    _assert_bit_exact(fetch_weights(publisher.address, 3, timeout_s=10)[1], v3)


def test_a_started_fetch_finishes_even_if_its_version_is_evicted():
    v1 = _state_dict(1)
    with WeightPublisher(chunk_bytes=CHUNK, keep_versions=1) as pub:
        pub.publish(1, v1)
        with iter_weights(pub.address, 1, timeout_s=10) as stream:
            first = next(stream)
            pub.publish(2, _state_dict(2))
            assert pub.versions == (2,)
            got = dict([first, *stream])
        _assert_bit_exact(got, v1)


def test_publish_rejects_bad_input_and_keeps_serving(publisher):
    publisher.publish(2, _state_dict())
    with pytest.raises(ValueError, match="not newer than the last published 2"):
        publisher.publish(2, _state_dict())
    with pytest.raises(ValueError, match=r"'z'.*complex64"):
        publisher.publish(3, {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="'x' is a list"):
        publisher.publish(3, {"x": [1.0]})  # type: ignore[dict-item]
    assert publisher.versions == (2,)
    _assert_bit_exact(fetch_weights(publisher.address, 2, timeout_s=10)[1], _state_dict())


def test_idle_sessions_expire():
    with WeightPublisher(chunk_bytes=CHUNK, session_timeout_s=0.1, session_sweep_s=0.05) as pub:
        pub.publish(1, _state_dict())
        with iter_weights(pub.address, 1, timeout_s=10) as stream:
            wait_until(lambda: pub.snapshot_counts().get("sessions_expired"), 10, "the idle session to expire")
            with pytest.raises(WeightTransferError, match="expired fetch session") as info:
                list(stream)
            assert info.value.reason == "unknown_session"


@pytest.mark.parametrize("field", ["session_timeout_s", "session_sweep_s"])
def test_session_periods_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be positive"):
        WeightPublisher(**{field: 0})


class _FailingPublisher(WeightPublisher):
    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        raise RuntimeError("disk on fire")


def test_a_request_that_fails_inside_the_publisher_is_answered_and_serving_goes_on():
    with _FailingPublisher(chunk_bytes=CHUNK) as pub:
        pub.publish(1, _state_dict())
        with pytest.raises(WeightTransferError, match="RuntimeError") as info:
            fetch_weights(pub.address, 1, timeout_s=10)
        assert info.value.reason == "internal"
        pub.publish(2, _state_dict())  # the loop lives on
        assert pub.snapshot_counts()["requests_refused/internal"] >= 1


class _BrokenLoopPublisher(WeightPublisher):
    def _expire_sessions(self, now: float) -> None:
        raise RuntimeError("disk on fire")


def test_a_failed_serving_loop_is_raised_on_the_next_call():
    pub = _BrokenLoopPublisher(chunk_bytes=CHUNK, session_sweep_s=0.05)
    pub._thread.join(30)  # the loop's first session expiry check fails, one sweep after the start
    assert not pub._thread.is_alive()
    with pytest.raises(WeightTransferError, match=r"serving loop failed.*disk on fire"):
        pub.publish(2, _state_dict())
    with pytest.raises(WeightTransferError, match=r"serving loop failed.*disk on fire"):
        pub.close()


def test_close_stops_serving_and_refuses_publish():
    pub = WeightPublisher(chunk_bytes=CHUNK)
    pub.publish(1, _state_dict())
    address = pub.address
    pub.close()
    pub.close()  # idempotent
    assert not pub._thread.is_alive()
    with pytest.raises(WeightTransferError, match="closed"):
        pub.publish(2, _state_dict())
    with pytest.raises(WeightTransferError, match="timed out"):
        fetch_weights(address, 1, timeout_s=0.3)


def test_binding_a_taken_address_is_a_clear_error(publisher):
    with pytest.raises(WeightTransferError, match="cannot bind"):
        WeightPublisher(publisher.address)


def test_malformed_requests_get_clear_errors_and_the_publisher_keeps_serving(publisher):
    import json
    import struct

    import zmq

    sd = _state_dict()
    publisher.publish(1, sd)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(publisher.address)
    try:

        def ask(*frames: bytes) -> list[bytes]:
            sock.send_multipart(list(frames))
            return sock.recv_multipart()

        def error(reply: list[bytes]) -> dict[str, str]:
            assert reply[0] == b"error", reply[:1]
            return json.loads(reply[1])

        assert error(ask(b"pickle", b"\x80\x04"))["reason"] == "protocol"
        assert "bad manifest request" in error(ask(PROTOCOL, b"manifest", b"{not json"))["message"]
        assert error(ask(PROTOCOL, b"frobnicate"))["message"] == "unknown request b'frobnicate'"
        request = json.dumps({"version": 1}).encode()
        kind, session, _, _ = ask(PROTOCOL, b"manifest", b"", request)  # [token (none), request]
        assert kind == b"manifest"
        big = list(sd).index("big")
        too_long = struct.pack("<IQQ", big, 0, CHUNK + 1)  # more than chunk_bytes at once
        assert "bad chunk request" in error(ask(PROTOCOL, b"chunk", session, too_long))["message"]
        past_end = struct.pack("<IQQ", big, 20_000, 20_021)
        assert "bad chunk request" in error(ask(PROTOCOL, b"chunk", session, past_end))["message"]
        unknown = struct.pack("<IQQ", 99, 0, 1)
        assert "bad chunk request" in error(ask(PROTOCOL, b"chunk", session, unknown))["message"]
        wrong = error(ask(PROTOCOL, b"chunk", b"x" * 16, struct.pack("<IQQ", big, 0, 8)))
        assert wrong["reason"] == "unknown_session"
        request_range = struct.pack("<IQQ", big, 8, 16)
        kind, header, data = ask(PROTOCOL, b"chunk", session, request_range)
        assert header == request_range
        assert kind == b"chunk" and data == bytes(tensor_bytes(sd["big"]))[8:16]
    finally:
        sock.close()
    _assert_bit_exact(fetch_weights(publisher.address, 1, timeout_s=10)[1], sd)


def test_floating_tensors_travel_in_the_float_dtype_asked_for(publisher):
    """A float32 trainer publishing for a bfloat16 replica: floating tensors are cast in the snapshot copy (half
    the bytes), the rest travel as they are, and the checksums cover what travels."""
    sd = _state_dict()
    manifest = publisher.publish(4, sd, float_dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    assert manifest == build_manifest(4, want)
    got_manifest, got = fetch_weights(publisher.address, 4, timeout_s=20)
    assert got_manifest == manifest
    _assert_bit_exact(got, want)
    assert {s.name: s.dtype for s in manifest.tensors}["position_ids"] == "int64"
    assert {s.name: s.nbytes for s in manifest.tensors}["big"] == 5 * 1001 * 2  # half of float32's 20020
    with pytest.raises(ValueError, match="floating dtype"):
        publisher.publish(5, sd, float_dtype=torch.int32)
