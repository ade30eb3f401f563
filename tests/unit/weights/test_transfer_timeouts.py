"""A weight transfer's bound scales with its bytes (fleetrl/weights/timeouts.py): a floor plus the bytes at a
conservative rate. Real ZeroMQ on 127.0.0.1; the slow publisher's sleep plays a slow link (the input, not a wait)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from fleetrl.weights import WeightPublisher, WeightStream, WeightTransferError, fetch_weights, transfer_timeout_s
from fleetrl.weights.timeouts import MIN_TRANSFER_RATE_BYTES_PER_S

CHUNK = 8192
WEIGHTS = {"w": torch.arange(16384, dtype=torch.float32)}  # 64 KiB: 8 chunks


class _SlowPublisher(WeightPublisher):
    """Serves each chunk `delay_s` late: 8 chunks take about 8 x delay_s."""

    delay_s = 0.25

    def _chunk_payload(self, snapshot: Any, tensor_index: int, start: int, stop: int) -> Any:
        time.sleep(self.delay_s)
        return super()._chunk_payload(snapshot, tensor_index, start, stop)


def test_the_budget_is_a_floor_plus_the_bytes_at_a_conservative_rate():
    assert MIN_TRANSFER_RATE_BYTES_PER_S == 100e6
    assert transfer_timeout_s(300.0, 0) == 300.0
    assert transfer_timeout_s(300.0, 16 * 10**9) == 460.0  # an 8B model in bfloat16
    assert transfer_timeout_s(300.0, 140 * 10**9) == 1700.0  # 70B
    assert transfer_timeout_s(1.0, 1000, rate_bytes_per_s=100.0) == 11.0
    for kwargs, field in [({"floor_s": 0}, "floor_s"), ({"nbytes": -1}, "nbytes"), ({"rate_bytes_per_s": 0}, "rate")]:
        with pytest.raises(ValueError, match=field):
            transfer_timeout_s(**{"floor_s": 1.0, "nbytes": 0, **kwargs})


def test_a_fetch_longer_than_the_floor_finishes_within_its_bytes_budget():
    with _SlowPublisher(chunk_bytes=CHUNK) as pub:
        pub.publish(1, WEIGHTS)
        # About 2 s on the wire, over the 1 s floor (before: the whole fetch failed after timeout_s); the budget at
        # 16 KiB/s is 1 + 4 s.
        manifest, got = fetch_weights(pub.address, 1, timeout_s=1.0, rate_bytes_per_s=16384)
        assert manifest.total_bytes == 65536 and torch.equal(got["w"], WEIGHTS["w"])


def test_the_budget_still_bounds_the_whole_fetch():
    with _SlowPublisher(chunk_bytes=CHUNK) as pub:
        pub.publish(1, WEIGHTS)
        # Each chunk comes well within the 1 s wait, but at a rate assumed 1 TB/s the budget is the 1 s floor.
        with pytest.raises(WeightTransferError, match="timed out") as info:
            fetch_weights(pub.address, 1, timeout_s=1.0, rate_bytes_per_s=1e12)
        assert info.value.reason == "timeout"


def test_a_streams_deadline_is_set_from_the_manifests_bytes():
    with WeightPublisher(chunk_bytes=CHUNK) as pub:
        pub.publish(1, WEIGHTS)
        before = time.monotonic()
        with WeightStream(pub.address, 1, timeout_s=10, budget_floor_s=2.0, rate_bytes_per_s=1000) as stream:
            after = time.monotonic()
            assert before + 2.0 + 65.536 <= stream.deadline <= after + 2.0 + 65.536
        with WeightStream(pub.address, 1, timeout_s=10) as stream:
            assert stream.deadline is None  # only each wait is bounded
