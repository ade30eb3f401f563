"""`RequestCoalescer`: seeded sampling calls of one prompt, made together, reach the engine as one request.

A gateway runs a row's G rollouts at once, and a rollout that samples once per call (n = 1, as the cookbook's
examples do) sends G requests with the same prompt and settings and different seeds. The coalescer holds each
seeded call for two turns of the event loop (the other rollouts of the row, started together, get there in that
time), then sends the held calls that differ only in their seeds as one request carrying `seeds`, one per
completion, and hands each caller its own completions. The engine then prefills the prompt once and samples the
G sequences in one batch (one gRPC call instead of G). A completion's tokens depend only on its seed, so what is
sampled does not change. Unseeded calls are sent as they are, and so are calls that differ in anything but the seed.

A caller cancelled while its call is held or in flight (a rollout timeout) just stops waiting; the shared request
is cancelled only when every caller has gone. A failed shared request fails every caller with its error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from fleetrl.clients.inference_types import SamplingRequest

MAX_MERGED_N = 64
"""Completions per merged request at most (more calls of one prompt go out as several requests)."""

Send = Callable[[SamplingRequest], Awaitable[list[Any]]]
_Held = tuple[SamplingRequest, asyncio.Future]


def merge_key(request: SamplingRequest) -> tuple | None:
    """What calls must share to be merged (None: an unseeded call, never merged)."""
    if request.seed is None and not request.seeds:
        return None
    return (
        tuple(request.prompt_token_ids),
        request.max_tokens,
        request.temperature,
        request.top_p,
        request.top_k,
        tuple(request.stop_token_ids),
        request.ignore_eos,
        request.stop,
    )


def merged_request(requests: list[SamplingRequest]) -> SamplingRequest:
    """One request for all of `requests` (same merge key): their completions' seeds, in order."""
    seeds = tuple(s for r in requests for s in (r.sequence_seed(i) for i in range(r.n)))
    return dataclasses.replace(requests[0], n=len(seeds), seed=None, seeds=seeds)


def split_completions(requests: list[SamplingRequest], completions: list[Any]) -> list[list[Any]]:
    """`completions` of the merged request, back to each request in order (ValueError if the count is wrong)."""
    total = sum(r.n for r in requests)
    if len(completions) != total:
        raise ValueError(f"the merged request asked for {total} completions and got {len(completions)}")
    out, start = [], 0
    for r in requests:
        out.append(list(completions[start : start + r.n]))
        start += r.n
    return out


def chunks(held: list[_Held], max_n: int) -> list[list[_Held]]:
    """`held` in order, cut so no chunk asks for more than `max_n` completions (a bigger call stays alone)."""
    out: list[list[_Held]] = []
    n = 0
    for item in held:
        if out and n + item[0].n <= max_n:
            out[-1].append(item)
            n += item[0].n
        else:
            out.append([item])
            n = item[0].n
    return out


class RequestCoalescer:
    """`await coalescer.generate(request)`: as `send(request)`, merged with concurrent calls of the same prompt."""

    def __init__(self, send: Send, max_n: int = MAX_MERGED_N) -> None:
        self._send = send
        self._max_n = max_n
        self._held: dict[tuple, list[_Held]] = {}
        self._scheduled = False
        self.requests_sent = 0  # engine requests made (merged or not)
        self.calls_merged = 0  # calls that shared a request with another

    async def generate(self, request: SamplingRequest) -> list[Any]:
        key = merge_key(request)
        if key is None:
            self.requests_sent += 1
            return await self._send(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._held.setdefault(key, []).append((request, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(loop.call_soon, self._flush)  # two turns: the row's other rollouts get here first
        return await future  # a cancelled caller cancels only its own future

    def _flush(self) -> None:
        held, self._held = self._held, {}
        self._scheduled = False
        for items in held.values():
            live = [item for item in items if not item[1].done()]
            for chunk in chunks(live, self._max_n):
                self._start(chunk)

    def _start(self, chunk: list[_Held]) -> None:
        requests = [r for r, _ in chunk]
        futures = [f for _, f in chunk]
        request = requests[0] if len(chunk) == 1 else merged_request(requests)
        self.requests_sent += 1
        if len(chunk) > 1:
            self.calls_merged += len(chunk)
        task = asyncio.ensure_future(self._send(request))
        waiting = [len(futures)]

        def caller_gone(future: asyncio.Future) -> None:
            if future.cancelled():
                waiting[0] -= 1
                if waiting[0] == 0:
                    task.cancel()

        for future in futures:
            future.add_done_callback(caller_gone)

        def done(task: asyncio.Task) -> None:
            if task.cancelled():  # every caller went, or the loop is closing
                for future in futures:
                    future.cancel()
                return
            results: list[Any] | BaseException
            if task.exception() is not None:
                results = task.exception()
            else:
                try:
                    results = split_completions(requests, task.result()) if len(chunk) > 1 else [task.result()]
                except ValueError as exc:
                    results = exc
            for i, future in enumerate(futures):
                if future.done():
                    continue
                if isinstance(results, BaseException):
                    future.set_exception(results)
                else:
                    future.set_result(results[i])

        task.add_done_callback(done)
