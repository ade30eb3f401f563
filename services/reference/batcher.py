"""`LogprobBatcher`: the reference service's request batching, apart from gRPC. Concurrent `submit` calls at one
temperature are coalesced into padded forwards of at most `max_batch_tokens` padded tokens (longest sequences
first, so little padding); the forward runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetrl.services.reference.metrics import ReferenceMetrics

logger = logging.getLogger(__name__)

ComputeFn = Callable[[list[list[int]], float], list[list[float]]]


@dataclass
class _Request:
    sequences: list[list[int]]
    temperature: float
    future: asyncio.Future[list[list[float]]]
    enqueued: float = field(default_factory=time.monotonic)


class LogprobBatcher:
    """Coalesces concurrent requests (same temperature) into padded forwards of at most
    `max_batch_tokens` padded tokens; the forward runs in a worker thread, off the event loop."""

    def __init__(
        self, compute: ComputeFn, *, max_batch_tokens: int, batch_wait_s: float, metrics: ReferenceMetrics | None
    ) -> None:
        self._compute = compute
        self._max_tokens = max_batch_tokens
        self._wait_s = batch_wait_s
        self._metrics = metrics
        self._queue: asyncio.Queue[_Request] = asyncio.Queue()
        self._carry: deque[_Request] = deque()
        self._task: asyncio.Task[None] | None = None

    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._carry)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reference-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for req in [*self._carry, *_drain(self._queue)]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("reference service is shutting down"))

    async def submit(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        if self._task is None or self._task.done():
            raise RuntimeError("reference batcher is not running")
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(sequences, temperature, future))
        return await future

    async def _next(self, timeout: float | None) -> _Request | None:
        if self._carry:
            return self._carry.popleft()
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self._next(None)
            assert first is not None
            batch = [first]
            tokens = sum(len(s) for s in first.sequences)
            deadline = loop.time() + self._wait_s
            while tokens < self._max_tokens:
                nxt = await self._next(max(0.0, deadline - loop.time()))
                if nxt is None:
                    break
                if nxt.temperature != first.temperature:
                    self._carry.append(nxt)
                    break
                batch.append(nxt)
                tokens += sum(len(s) for s in nxt.sequences)
            await self._serve(batch)

    async def _serve(self, batch: list[_Request]) -> None:
        sequences = [s for req in batch for s in req.sequences]
        try:
            results = await self._forward_all(sequences, batch[0].temperature)
        except Exception as exc:  # the callers get the error; the batcher keeps serving
            logger.exception("reference forward failed")
            for req in batch:
                if not req.future.done():
                    req.future.set_exception(exc)
            return
        start = 0
        for req in batch:
            n = len(req.sequences)
            if not req.future.done():
                req.future.set_result(results[start : start + n])
            start += n

    async def _forward_all(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """Forwards of at most max_batch_tokens padded tokens, longest first (less padding)."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        results: list[list[float]] = [[] for _ in sequences]
        i = 0
        while i < len(order):
            width = len(sequences[order[i]])
            j = i + 1
            while j < len(order) and (j - i + 1) * width <= self._max_tokens:
                j += 1
            chunk = [sequences[k] for k in order[i:j]]
            started = time.perf_counter()
            out = await asyncio.to_thread(self._compute, chunk, temperature)
            if self._metrics is not None:
                self._metrics.observe_forward(len(chunk), sum(len(s) for s in chunk), time.perf_counter() - started)
            for k, lp in zip(order[i:j], out, strict=True):
                results[k] = lp
            i = j
        return results


def _drain(queue: asyncio.Queue[_Request]) -> list[_Request]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out
