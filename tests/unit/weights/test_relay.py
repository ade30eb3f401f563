"""Weight relays over real ZeroMQ sockets on 127.0.0.1, and the (pure) relay plan."""

from __future__ import annotations

import errno
import threading
from typing import Any

import pytest
import torch
import zmq

from fleetrl.weights import (
    WeightPublisher,
    WeightRelay,
    WeightTransferError,
    fetch_weights,
    iter_weights,
    plan_relay,
    relay_depth,
)
from fleetrl.weights.manifest import tensor_bytes
from fleetrl.weights.protocol import PROTOCOL, RANGE, parse_error
from tests.waiting import wait_until

CHUNK = 4096  # the publisher's largest message
PIECE = 1500  # the relays' pipelining grain: several tensors arrive in pieces, at odd offsets


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 13, generator=gen),  # 1924 B: two pieces
        "layer.0.attn.q.weight": torch.randn(3000, generator=gen).to(torch.bfloat16),
        "layer.0.norm.weight": torch.randn(13, generator=gen).to(torch.bfloat16),
        "big": torch.randn(5, 1001, generator=gen),  # 20020 B: split upstream and at every hop
        "position_ids": torch.arange(257, dtype=torch.int64).reshape(1, 257),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(-1.5),
        "mask": torch.rand(9, generator=gen) > 0.5,
    }


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert bytes(tensor_bytes(got[name])) == bytes(tensor_bytes(tensor.contiguous())), name


def _relay(upstream: str, version: int = 1, **kwargs: Any) -> WeightRelay:
    kwargs.setdefault("timeout_s", 10)
    kwargs.setdefault("chunk_bytes", PIECE)
    return WeightRelay(upstream, version, **kwargs)


# -- the plan -----------------------------------------------------------------------------------


def test_fanout_one_is_a_chain_and_the_publisher_serves_one_copy():
    plan = plan_relay(["a", "b", "c", "d"], 1)
    assert plan == {"a": None, "b": "a", "c": "b", "d": "c"}
    assert relay_depth(plan) == 4


def test_fanout_k_is_a_breadth_first_k_ary_tree():
    plan = plan_relay(list(range(7)), 2)
    assert plan == {0: None, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}
    assert relay_depth(plan) == 3
    served = [list(plan.values()).count(r) for r in range(7)]
    assert max(served) == 2


def test_root_fanout_spreads_the_first_level_and_covers_the_direct_plan():
    assert plan_relay(["a", "b", "c", "d"], 2, root_fanout=2) == {"a": None, "b": None, "c": "a", "d": "a"}
    direct = plan_relay(["a", "b", "c"], 3, root_fanout=3)
    assert direct == {"a": None, "b": None, "c": None}
    assert relay_depth(direct) == 1
    assert plan_relay([], 2) == {}
    assert relay_depth({}) == 0


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_a_replica_joining_later_gets_a_peer_and_nobody_elses_upstream_changes(fanout):
    before = plan_relay([f"r{i}" for i in range(5)], fanout)
    after = plan_relay([f"r{i}" for i in range(6)], fanout)
    assert {k: after[k] for k in before} == before
    assert after["r5"] is not None


@pytest.mark.parametrize(
    ("replicas", "fanout", "root_fanout", "message"),
    [
        (["a"], 0, 1, "fanout must be"),
        (["a"], 1, 0, "root_fanout must be"),
        (["a", "a"], 1, 1, "distinct"),
    ],
)
def test_plan_rejects_bad_arguments(replicas, fanout, root_fanout, message):
    with pytest.raises(ValueError, match=message):
        plan_relay(replicas, fanout, root_fanout=root_fanout)


def test_relay_depth_rejects_an_upstream_planned_after_its_downstream():
    with pytest.raises(ValueError, match="not planned before it"):
        relay_depth({"b": "a", "a": None})


# -- relays end to end --------------------------------------------------------------------------


@pytest.fixture
def publisher():
    with WeightPublisher(chunk_bytes=CHUNK) as pub:
        yield pub


class _CountingPublisher(WeightPublisher):
    manifests_served = 0

    def _serve_manifest(self, sock: Any, peer: bytes, args: list[bytes]) -> None:
        self.manifests_served += 1
        super()._serve_manifest(sock, peer, args)


def test_a_chain_of_three_relays_delivers_identical_tensors_at_every_hop():
    sd = _state_dict()
    publisher = _CountingPublisher(chunk_bytes=CHUNK)
    manifest = publisher.publish(1, sd)
    # r3 asks for smaller pieces than r2 received, on another grid: some ranges span two of them.
    with (
        publisher,
        _relay(publisher.address) as r1,
        _relay(r1.address) as r2,
        _relay(r2.address, chunk_bytes=1000) as r3,
    ):
        for relay in (r1, r2, r3):
            got_manifest, tensors = relay.wait(timeout_s=30)
            assert got_manifest == manifest
            _assert_bit_exact(tensors, sd)
            assert relay.done and relay.error is None
        # An unchanged fetch_weights fetches from the end of the chain.
        got_manifest, tensors = fetch_weights(r3.address, 1, timeout_s=10)
        assert got_manifest == manifest
        _assert_bit_exact(tensors, sd)
        assert r1.chunk_bytes == PIECE
        assert publisher.manifests_served == 1  # the trainer served one copy: the first relay's


def test_a_tree_of_relays_planned_by_plan_relay_delivers_to_every_replica(publisher):
    sd = _state_dict(seed=1)
    publisher.publish(4, sd)
    plan = plan_relay(["r0", "r1", "r2", "r3", "r4"], 2)
    relays: dict[str, WeightRelay] = {}
    try:
        for replica, upstream in plan.items():
            address = publisher.address if upstream is None else relays[upstream].address
            relays[replica] = _relay(address, 4)
        for relay in relays.values():
            _, tensors = relay.wait(timeout_s=30)
            _assert_bit_exact(tensors, sd)
        # Local consumers may also stream, and more than once.
        assert [name for name, _ in relays["r4"].iter_weights()] == list(sd)
        assert [name for name, _ in relays["r4"].iter_weights()] == list(sd)
    finally:
        for relay in relays.values():
            relay.close()


def test_a_fetcher_starting_after_the_relay_completed_gets_it_from_the_relay_alone(publisher):
    sd = _state_dict(seed=2)
    publisher.publish(2, sd)
    with _relay(publisher.address, 2) as relay:
        relay.wait(timeout_s=30)
        publisher.close()  # the trainer is gone: a replica joining now fetches from its peer
        _, tensors = fetch_weights(relay.address, 2, timeout_s=10)
        _assert_bit_exact(tensors, sd)
        with _relay(relay.address, 2) as late:
            _, tensors = late.wait(timeout_s=30)
            _assert_bit_exact(tensors, sd)
        assert relay.counts["chunks_deferred"] == 0  # everything was there when asked for


class _GatedPublisher(WeightPublisher):
    """Holds every chunk of the tensors after the first until ``gate`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        if tensor_index >= 1:
            self.gate.wait(30)
        return super()._chunk_payload(snapshot, tensor_index, start, stop)


def test_relaying_is_pipelined_a_downstream_gets_its_first_tensor_before_the_relay_has_the_rest():
    sd = _state_dict(seed=3)
    with _GatedPublisher(chunk_bytes=CHUNK) as pub:
        try:
            pub.publish(1, sd)
            with _relay(pub.address) as r1, _relay(r1.address) as r2:
                stream = iter_weights(r2.address, 1, timeout_s=10)
                name, tensor = next(stream)  # through two hops while the rest is held upstream
                assert name == "embed.weight"
                assert torch.equal(tensor, sd[name])
                assert not r1.done and not r2.done  # neither relay had the whole version yet
                pub.gate.set()
                rest = dict(stream)
                _assert_bit_exact({name: tensor, **rest}, sd)
                assert r1.wait(timeout_s=30)[1].keys() == sd.keys()
        finally:
            pub.gate.set()


class _PieceGatedPublisher(WeightPublisher):
    """Holds the bytes of tensor "big" from offset 3000 on until ``gate`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()

    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        if snapshot.manifest.tensors[tensor_index].name == "big" and start >= 3000:
            self.gate.wait(30)
        return super()._chunk_payload(snapshot, tensor_index, start, stop)


def test_pieces_of_a_tensor_are_served_on_before_the_whole_tensor_has_arrived():
    sd = _state_dict(seed=4)
    with _PieceGatedPublisher(chunk_bytes=CHUNK) as pub:
        try:
            manifest = pub.publish(1, sd)
            before_big = sum(-(-spec.nbytes // PIECE) for spec in manifest.tensors[: list(sd).index("big")])
            with _relay(pub.address) as r1, _relay(r1.address) as r2:
                # r1 holds big[0:3000) of 20020 bytes; its two pieces reach r2 all the same.
                wait_until(
                    lambda: r1.counts["chunks_served"] == before_big + 2,
                    10,
                    "the first two pieces of 'big' to be served on by r1",
                )
                assert not r1.done
                pub.gate.set()
                _assert_bit_exact(r2.wait(timeout_s=30)[1], sd)
        finally:
            pub.gate.set()


class _CorruptingPublisher(_GatedPublisher):
    """Flips a bit of tensor "big" (once ``gate`` lets the tensors after the first go)."""

    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        payload = super()._chunk_payload(snapshot, tensor_index, start, stop)
        if snapshot.manifest.tensors[tensor_index].name == "big" and start == 0:
            payload = bytearray(payload)
            payload[7] ^= 0x10
        return payload


def test_corrupted_bytes_upstream_are_detected_at_the_next_hop_and_fail_every_hop_below():
    sd = _state_dict()
    with _CorruptingPublisher(chunk_bytes=CHUNK) as pub:
        try:
            pub.publish(1, sd)
            with _relay(pub.address) as r1, _relay(r1.address) as r2:
                pub.gate.set()  # both relays hold the manifest: now let the corruption through
                seen = []
                with pytest.raises(WeightTransferError, match="checksum mismatch for tensor 'big'") as info:
                    for name, _ in r1.iter_weights():
                        seen.append(name)
                assert info.value.reason == "checksum"
                assert seen == list(sd)[: list(sd).index("big")]  # the good tensors before it were handed out
                with pytest.raises(WeightTransferError) as info:
                    r2.wait(timeout_s=30)
                assert info.value.reason == "checksum"
                # A fetch starting now is refused with the upstream's reason.
                with pytest.raises(WeightTransferError, match="lost its upstream") as info:
                    fetch_weights(r1.address, 1, timeout_s=10)
                assert info.value.reason == "checksum"
        finally:
            pub.gate.set()


class _DyingPublisher(WeightPublisher):
    """Serves the first tensor, then answers nothing (``asked`` tells the test it got that far)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.asked = threading.Event()

    def _serve_chunk(self, sock: Any, peer: bytes, args: list[bytes]) -> None:
        if len(args) == 2 and len(args[1]) == RANGE.size and RANGE.unpack(args[1])[0] >= 1:
            self.asked.set()
            return
        super()._serve_chunk(sock, peer, args)


def test_an_upstream_dying_mid_transfer_is_a_weight_transfer_error_at_every_hop_below():
    sd = _state_dict()
    pub = _DyingPublisher(chunk_bytes=CHUNK)
    try:
        pub.publish(1, sd)
        # r1 gives up on its upstream 2 s after the last piece (long enough for r2 to fetch its manifest first).
        with _relay(pub.address, timeout_s=2) as r1, _relay(r1.address, timeout_s=30) as r2:
            stream = iter_weights(r2.address, 1, timeout_s=60)
            name, _ = next(stream)
            assert name == "embed.weight"
            assert pub.asked.wait(10)
            pub.close()  # the upstream dies with the rest of the version unsent
            with pytest.raises(WeightTransferError, match="lost its upstream") as info:
                dict(stream)  # answered by r2's error reply, long before this fetch's own 60 s
            assert info.value.reason == "timeout"
            for relay in (r1, r2):
                with pytest.raises(WeightTransferError):
                    relay.wait(timeout_s=60)
                assert relay.error is not None and relay.error.reason == "timeout"
            assert "lost its upstream" in str(r2.error)
    finally:
        pub.close()


def test_a_relay_checks_tokens_and_versions_like_a_publisher():
    sd = _state_dict()
    with WeightPublisher(chunk_bytes=CHUNK, auth_token="s3cret") as pub:
        pub.publish(5, sd)
        with pytest.raises(WeightTransferError) as info:
            _relay(pub.address, 5)  # no token: the upstream refuses at once
        assert info.value.reason == "auth"
        with _relay(pub.address, 5, auth_token="s3cret") as relay:
            with pytest.raises(WeightTransferError) as info:
                fetch_weights(relay.address, 5, timeout_s=10, auth_token="wrong")
            assert info.value.reason == "auth"
            with pytest.raises(WeightTransferError) as info:
                fetch_weights(relay.address, 4, timeout_s=10, auth_token="s3cret")
            assert info.value.reason == "unknown_version"
            _, tensors = fetch_weights(relay.address, 5, timeout_s=10, auth_token="s3cret")
            _assert_bit_exact(tensors, sd)


def test_no_upstream_is_a_timeout_from_the_constructor(free_port):
    with pytest.raises(WeightTransferError) as info:
        WeightRelay(f"tcp://127.0.0.1:{free_port}", 1, timeout_s=0.3)
    assert info.value.reason == "timeout"


def test_a_closed_relay_refuses_its_consumers(publisher):
    publisher.publish(1, _state_dict())
    relay = _relay(publisher.address)
    relay.wait(timeout_s=30)
    relay.close()
    relay.close()  # idempotent
    with pytest.raises(WeightTransferError) as info:
        relay.wait()
    assert info.value.reason == "closed"


def test_malformed_requests_get_error_replies_and_the_relay_keeps_serving(publisher):
    sd = _state_dict()
    publisher.publish(1, sd)
    with _relay(publisher.address) as relay:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(relay.address)
        try:
            requests = [
                ([b"nope", b"manifest"], "protocol"),
                ([PROTOCOL, b"bogus"], "protocol"),
                ([PROTOCOL, b"manifest", b"", b"{not json"], "protocol"),
                ([PROTOCOL, b"chunk", b"x" * 16, RANGE.pack(0, 0, 4)], "unknown_session"),
            ]
            for frames, reason in requests:
                sock.send_multipart(frames)
                assert sock.poll(10_000), frames
                kind, payload = sock.recv_multipart()
                assert kind == b"error"
                assert parse_error(payload)[0] == reason
            # A range beyond the tensor, within a real session.
            sock.send_multipart([PROTOCOL, b"manifest", b"", b'{"version": 1}'])
            assert sock.poll(10_000)
            session_id = sock.recv_multipart()[1]
            sock.send_multipart([PROTOCOL, b"chunk", session_id, RANGE.pack(0, 0, 10**9)])
            assert sock.poll(10_000)
            kind, payload = sock.recv_multipart()
            assert kind == b"error" and parse_error(payload)[0] == "protocol"
        finally:
            sock.close()
        _, tensors = fetch_weights(relay.address, 1, timeout_s=10)
        _assert_bit_exact(tensors, sd)
        assert relay.counts["requests_refused/protocol"] == 4


def test_binding_a_taken_address_is_a_clear_error(publisher):
    publisher.publish(1, _state_dict())
    with pytest.raises(WeightTransferError, match="cannot bind") as info:
        _relay(publisher.address, bind=publisher.address)
    assert info.value.reason == "publisher"
    with _relay(publisher.address) as relay:  # the publisher is unharmed
        relay.wait(timeout_s=30)


class _UnanswerableRelay(WeightRelay):
    """Error replies fail with a ZeroMQ error other than "unreachable" (the publisher's refusal path drops them)."""

    def _send(self, sock: Any, peer: bytes, frames: list[Any]) -> bool:
        if frames and frames[0] == b"error":
            raise zmq.ZMQError(errno.ENOBUFS)
        return super()._send(sock, peer, frames)


def test_a_refusal_that_cannot_be_sent_is_dropped_and_the_relay_keeps_serving(publisher):
    sd = _state_dict()
    publisher.publish(1, sd)
    relay = _UnanswerableRelay(publisher.address, 1, timeout_s=10, chunk_bytes=PIECE)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(relay.address)
        try:
            sock.send_multipart([b"nope", b"manifest"])  # refused; its reply fails to send
            wait_until(lambda: relay.counts["requests_refused/protocol"] == 1, 30, "the refusal")
        finally:
            sock.close()
        _, tensors = fetch_weights(relay.address, 1, timeout_s=10)  # before: the serving loop had died
        _assert_bit_exact(tensors, sd)
    finally:
        relay.close()  # before: raised "weight relay serving loop failed: ZMQError"
