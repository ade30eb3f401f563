"""The reference service's `LogprobBatcher`: concurrent requests at one temperature share a forward, another
temperature waits for its own, forwards hold at most max_batch_tokens padded tokens (longest first), every caller
gets its own sequences' results in order, a failed forward fails only its callers, and a stop fails the waiting."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fleetrl.services.reference.batcher import LogprobBatcher

WAIT_S = 60.0  # batches below are closed by max_batch_tokens or a temperature change, never by this wait


class GatedCompute:
    """A fake forward: logprob of token t at temperature T is -t / T; records each forward's (sequences, T).
    While `gate` is clear, forwards block (so requests pile up behind the one in flight)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], float]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        self.calls.append(([list(s) for s in sequences], temperature))
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if any(t < 0 for s in sequences for t in s):
            raise RuntimeError("forward failed")
        return [[-t / temperature for t in s[1:]] for s in sequences]


def expected(sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    return [[-t / temperature for t in s[1:]] for s in sequences]


async def test_requests_waiting_behind_a_forward_share_the_next_one_per_temperature():
    compute = GatedCompute()
    compute.gate.clear()
    batcher = LogprobBatcher(compute, max_batch_tokens=8, batch_wait_s=WAIT_S, metrics=None)
    batcher.start()
    try:
        first = asyncio.create_task(batcher.submit([[1, 2, 3, 4, 5, 6, 7, 8]], 1.0))
        await asyncio.to_thread(compute.entered.wait, 60)  # the first forward is in flight
        a = asyncio.create_task(batcher.submit([[5, 6]], 1.0))
        b = asyncio.create_task(batcher.submit([[7, 8]], 1.0))
        c = asyncio.create_task(batcher.submit([[9, 10], [11, 12]], 0.5))
        d = asyncio.create_task(batcher.submit([[13, 14, 15, 16], [17, 18, 19, 20]], 1.0))
        compute.gate.set()  # the submits above are queued before the batcher resumes (FIFO event loop)
        results = await asyncio.wait_for(asyncio.gather(first, a, b, c, d), 60)
    finally:
        await batcher.stop()
    assert results == [
        expected([[1, 2, 3, 4, 5, 6, 7, 8]]),
        expected([[5, 6]]),
        expected([[7, 8]]),
        expected([[9, 10], [11, 12]], 0.5),
        expected([[13, 14, 15, 16], [17, 18, 19, 20]]),
    ]
    assert compute.calls == [
        ([[1, 2, 3, 4, 5, 6, 7, 8]], 1.0),
        ([[5, 6], [7, 8]], 1.0),  # two requests, one forward
        ([[9, 10], [11, 12]], 0.5),  # another temperature ends the batch and waits for a forward of its own
        ([[13, 14, 15, 16], [17, 18, 19, 20]], 1.0),
    ]


async def test_forwards_hold_at_most_max_batch_tokens_padded_longest_first_and_results_keep_request_order():
    compute = GatedCompute()
    batcher = LogprobBatcher(compute, max_batch_tokens=6, batch_wait_s=WAIT_S, metrics=None)
    batcher.start()
    sequences = [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14]]
    try:
        result = await batcher.submit(sequences, 2.0)
    finally:
        await batcher.stop()
    assert result == expected(sequences, 2.0)
    assert [call[0] for call in compute.calls] == [[[6, 7, 8, 9, 10, 11]], [[3, 4, 5], [12, 13, 14]], [[1, 2]]]
    assert all(len(seqs) * max(len(s) for s in seqs) <= 6 for seqs, _ in compute.calls)


async def test_a_failed_forward_fails_its_callers_and_the_batcher_keeps_serving():
    compute = GatedCompute()
    batcher = LogprobBatcher(compute, max_batch_tokens=2, batch_wait_s=WAIT_S, metrics=None)
    batcher.start()
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            await batcher.submit([[1, -1]], 1.0)
        assert await batcher.submit([[1, 2]], 1.0) == expected([[1, 2]])
    finally:
        await batcher.stop()


async def test_stop_fails_the_queued_requests_and_later_submits():
    compute = GatedCompute()
    compute.gate.clear()
    batcher = LogprobBatcher(compute, max_batch_tokens=2, batch_wait_s=WAIT_S, metrics=None)
    batcher.start()
    in_flight = asyncio.create_task(batcher.submit([[1, 2]], 1.0))
    await asyncio.to_thread(compute.entered.wait, 60)
    queued = asyncio.create_task(batcher.submit([[3, 4]], 1.0))  # queued while stop() awaits the batcher's end
    await batcher.stop()
    compute.gate.set()
    with pytest.raises(RuntimeError, match="shutting down"):
        await asyncio.wait_for(queued, 60)
    with pytest.raises(RuntimeError, match="not running"):
        await batcher.submit([[5, 6]], 1.0)
    in_flight.cancel()
