"""Where the policy trainer gets reference logprobs (kl_beta > 0): the reference service over gRPC. The other
source, "local", is the colocated copy: a frozen base model inside the trainer's own ranks, on its device and in its
compute dtype, sharded like the policy (`PolicyTrainer(colocated_reference=True)`), whose logprobs come from the
training micro-batches themselves.

`make_reference_fn` returns the plain callable `PolicyTrainer` takes, `(sequences, temperature) ->
logprobs`, called from the trainer's reference thread while the trainer runs its own forward.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from fleetrl.trainer.policy_trainer import RefLogprobsFn


class LoopThread:
    """An asyncio loop in a daemon thread, for calling async clients from synchronous code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleetrl-ref-loop", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"no reply within {timeout_s}s") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


def make_reference_fn(
    reference: str | None, run_cfg: Any, *, auth_token: str | None, timeout_s: float, device: str
) -> RefLogprobsFn | None:
    """None (no KL, or "local": the colocated copy `PolicyTrainer(colocated_reference=True)` loads itself), or a
    client of the reference service at HOST:PORT."""
    if reference is None or reference == "local":
        return None

    from fleetrl.clients.reference import ReferenceClient

    loop = LoopThread()

    async def make_client() -> ReferenceClient:
        return ReferenceClient(reference, auth_token=auth_token, timeout_s=timeout_s)

    client: ReferenceClient = loop.call(make_client(), timeout_s)

    def remote(sequences: list[list[int]], temperature: float) -> list[list[float]]:
        try:
            return loop.call(client.compute_logprobs(sequences, temperature), timeout_s + 5.0)
        except Exception as exc:  # name the service in the error the step reports
            raise RuntimeError(f"reference logprobs from {reference} failed: {exc}") from exc

    return remote
