"""`RequestCoalescer` (fleetrl/gateway/sampler_coalesce.py): seeded calls of one prompt made together become one request
with a seed per completion, each caller gets its own completions back, and cancellation and failures stay each
caller's own. A fake `send` records the requests (pure logic; the engines' side of `seeds` is in the conformance
suite, the sampler's over real gRPC in tests/unit/gateway/test_sampler_merging.py)."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.gateway.sampler_coalesce import RequestCoalescer, chunks, merged_request, split_completions
from tests.waiting import async_wait_until


class Engine:
    """A fake send: answers each completion with its seed (so a caller can tell whose completion it got). With
    `held`, a request is answered only once the test sets `release` (it is in flight until then)."""

    def __init__(self, held: bool = False, error: BaseException | None = None, short: bool = False) -> None:
        self.requests: list[SamplingRequest] = []
        self.cancelled = 0
        self.release = asyncio.Event()
        if not held:
            self.release.set()
        self.error, self.short = error, short

    async def send(self, request: SamplingRequest) -> list[int | None]:
        self.requests.append(request)
        try:
            await asyncio.wait_for(self.release.wait(), 30.0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        seeds = [request.sequence_seed(i) for i in range(request.n)]
        return seeds[:-1] if self.short else seeds


def req(prompt=(1, 2, 3), n=1, seed=None, **kw) -> SamplingRequest:
    return SamplingRequest(list(prompt), n=n, max_tokens=5, seed=seed, **kw)


async def test_a_rows_seeded_calls_go_out_as_one_request_and_each_caller_gets_its_own():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)
    results = await asyncio.gather(*(coalescer.generate(req(seed=100 + i)) for i in range(8)))
    assert results == [[100 + i] for i in range(8)]
    (sent,) = engine.requests
    assert sent.n == 8 and sent.seeds == tuple(100 + i for i in range(8)) and sent.seed is None
    assert coalescer.requests_sent == 1 and coalescer.calls_merged == 8


async def test_calls_from_tasks_started_together_are_merged():
    """As the gateway runs them: each rollout in its own task (wait_for and gather make tasks)."""
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)

    async def rollout(i: int) -> list:
        return await asyncio.wait_for(coalescer.generate(req(seed=i)), 5.0)

    assert await asyncio.gather(*(rollout(i) for i in range(4))) == [[0], [1], [2], [3]]
    assert len(engine.requests) == 1


async def test_an_n_2_call_keeps_its_seed_plus_i():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)
    a, b = await asyncio.gather(coalescer.generate(req(n=2, seed=10)), coalescer.generate(req(seed=50)))
    assert a == [10, 11] and b == [50]
    assert engine.requests[0].seeds == (10, 11, 50)


async def test_different_prompts_settings_or_no_seed_are_not_merged():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)
    calls = [
        req(seed=1),
        req(seed=2),
        req(prompt=(9,), seed=3),
        req(seed=4, temperature=0.5),
        req(seed=None),
        req(seed=5, stop_token_ids=(7,)),
        req(seed=6, stop=("x",)),
    ]
    results = await asyncio.gather(*(coalescer.generate(r) for r in calls))
    assert results[:4] == [[1], [2], [3], [4]] and results[5] == [5] and results[6] == [6]
    assert sorted(r.n for r in engine.requests) == [1, 1, 1, 1, 1, 2]
    assert [r.stop for r in engine.requests if r.seed == 6] == [("x",)]
    unseeded = [r for r in engine.requests if r.seed is None and not r.seeds]
    assert len(unseeded) == 1  # sent as it was


async def test_calls_made_later_are_not_held_for_earlier_ones():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)
    assert await coalescer.generate(req(seed=1)) == [1]
    assert await coalescer.generate(req(seed=2)) == [2]
    assert [r.n for r in engine.requests] == [1, 1]


async def test_merged_requests_are_cut_at_max_n():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send, max_n=3)
    results = await asyncio.gather(*(coalescer.generate(req(seed=i)) for i in range(7)))
    assert results == [[i] for i in range(7)]
    assert [r.n for r in engine.requests] == [3, 3, 1]


async def test_a_cancelled_caller_does_not_cancel_the_others():
    engine = Engine(held=True)
    coalescer = RequestCoalescer(engine.send)
    calls = [asyncio.ensure_future(coalescer.generate(req(seed=i))) for i in range(3)]
    await async_wait_until(lambda: engine.requests, 5.0, "the merged request sent")
    calls[1].cancel()
    await async_wait_until(calls[1].done, 5.0, "the caller gone while its request is in flight")
    engine.release.set()
    assert await calls[0] == [0] and await calls[2] == [2]
    assert calls[1].cancelled() and engine.cancelled == 0


async def test_a_caller_cancelled_while_held_is_left_out():
    engine = Engine()
    coalescer = RequestCoalescer(engine.send)
    calls = [asyncio.ensure_future(coalescer.generate(req(seed=i))) for i in range(3)]
    await asyncio.sleep(0)  # one loop turn, no time: the calls are held (the flush comes two turns later)
    assert not engine.requests
    calls[0].cancel()
    assert await calls[1] == [1] and await calls[2] == [2]
    assert engine.requests[0].seeds == (1, 2)


async def test_the_request_is_cancelled_once_every_caller_has_gone():
    engine = Engine(held=True)
    coalescer = RequestCoalescer(engine.send)
    calls = [asyncio.ensure_future(coalescer.generate(req(seed=i))) for i in range(2)]
    await async_wait_until(lambda: engine.requests, 5.0, "the merged request sent")
    for call in calls:
        call.cancel()
    await async_wait_until(lambda: engine.cancelled, 5.0, "the request cancelled")
    assert engine.cancelled == 1 and len(engine.requests) == 1


async def test_a_failed_request_fails_every_caller_with_its_error():
    engine = Engine(error=ConnectionError("replica gone"))
    coalescer = RequestCoalescer(engine.send)
    results = await asyncio.gather(*(coalescer.generate(req(seed=i)) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) and "replica gone" in str(r) for r in results)


async def test_a_wrong_completion_count_fails_every_caller_saying_so():
    engine = Engine(short=True)
    coalescer = RequestCoalescer(engine.send)
    results = await asyncio.gather(*(coalescer.generate(req(seed=i)) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ValueError) and "asked for 3 completions and got 2" in str(r) for r in results)


def test_merge_and_split_are_inverse():
    requests = [req(seed=5), req(n=3, seed=20), req(seeds=(7, 8), n=2)]
    merged = merged_request(requests)
    assert merged.seeds == (5, 20, 21, 22, 7, 8) and merged.n == 6
    merged.validate()
    assert split_completions(requests, list("abcdef")) == [["a"], ["b", "c", "d"], ["e", "f"]]
    with pytest.raises(ValueError, match="asked for 6"):
        split_completions(requests, list("abc"))


def test_a_call_bigger_than_max_n_goes_alone():
    held = [(req(n=5, seed=1), None), (req(seed=2), None), (req(seed=3), None)]
    assert [[r.n for r, _ in c] for c in chunks(held, 2)] == [[5], [1, 1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 2, "seeds": (1,)}, "one seed per completion"),
        ({"n": 1, "seeds": (1,), "seed": 3}, "not both"),
        ({"n": 2, "seeds": (1, 2**63)}, r"every seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_bad_seeds_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingRequest([1, 2], max_tokens=2, **kwargs).validate()
