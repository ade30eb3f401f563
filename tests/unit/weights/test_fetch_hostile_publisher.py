"""A fetch from something that is not a well-behaved publisher (a scripted ROUTER on loopback) fails with a
WeightTransferError naming a protocol error, never with another exception, whatever the replies hold."""

from __future__ import annotations

import json
import threading

import pytest
import zmq

from fleetrl.weights import WeightTransferError, fetch_weights
from fleetrl.weights.protocol import PROTOCOL

GOOD_HEADER = json.dumps({"chunk_bytes": 4096}).encode()
REPLIES: dict[str, list[bytes]] = {
    "garbage": [b"\xff\xfe"],
    "error reply that is deeply nested JSON": [b"error", b"[" * 100_000],
    "error reply that is not JSON": [b"error", b"{nope"],
    "transfer header that is deeply nested JSON": [b"manifest", b"s" * 16, b"[" * 100_000, b"{}"],
    "transfer header with a negative chunk size": [b"manifest", b"s" * 16, b'{"chunk_bytes": -1}', b"{}"],
    "manifest that is deeply nested JSON": [b"manifest", b"s" * 16, GOOD_HEADER, b"[" * 100_000],
    "manifest that is a JSON list": [b"manifest", b"s" * 16, GOOD_HEADER, b"[]"],
    "manifest that is invalid UTF-8": [b"manifest", b"s" * 16, GOOD_HEADER, b"\xff\xfe"],
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_a_hostile_reply_to_the_manifest_request_is_a_protocol_error(name):
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    received: list[list[bytes]] = []

    def answer_once() -> None:
        if router.poll(15_000):
            frames = router.recv_multipart()
            received.append(frames[1:])
            router.send_multipart([frames[0], *REPLIES[name]])

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        with pytest.raises(WeightTransferError) as info:
            fetch_weights(f"tcp://127.0.0.1:{port}", 1, timeout_s=15, auth_token="tok")
    finally:
        thread.join(20)
        router.close(linger=0)
    assert info.value.reason == "protocol", str(info.value)
    # The request itself: the token in its own frame, then the JSON (no token inside).
    assert received[0][:3] == [PROTOCOL, b"manifest", b"tok"] and json.loads(received[0][3]) == {"version": 1}
