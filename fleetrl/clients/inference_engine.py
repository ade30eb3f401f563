"""`RemoteEngineClient`: vLLM's ``VLLMWeightSyncClient`` for a fleetrl vLLM replica behind its gRPC server (the
JoinEngineGroup / StartEngineUpdate / EngineUpdate / FinishEngineUpdate methods of fleetrl.v1.Inference), for the
trainer's weight-transfer engine (fleetrl.weights.vllm_gloo), which calls it from its own threads. Each call runs
on the event loop that owns the `InferenceClient` (`loop`) and waits up to its timeout (plus the channel's slack).
In-process replicas use services/inference/vllm_transfer.LocalEngineClient instead; the calls are the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fleetrl.clients.inference import InferenceClient


class RemoteEngineClient:
    """The four weight-transfer calls to one replica over gRPC. `engine_name`: the engine the group runs
    ("fleetrl_gloo" on CPU); `timeout_s`: each call's timeout on the server and on the wire."""

    def __init__(
        self,
        client: InferenceClient,
        loop: asyncio.AbstractEventLoop,
        engine_name: str = "fleetrl_gloo",
        timeout_s: float = 120.0,
    ) -> None:
        self.client = client
        self.loop = loop
        self.engine_name = engine_name
        self.timeout_s = timeout_s

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run(self.client.join_engine_group(self.engine_name, dict(init_info), timeout_s=self.timeout_s))

    def start_weight_update(self) -> None:
        self._run(self.client.start_engine_update(timeout_s=self.timeout_s))

    def update_weights(self, update_info: Any) -> None:
        info = dict(update_info)
        self._run(self.client.engine_update(int(info["version"]), info, timeout_s=self.timeout_s))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            raise ValueError("finish_weight_update: weight_version is required (the version the replica received)")
        self._run(self.client.finish_engine_update(int(weight_version), timeout_s=self.timeout_s))

    def abort_weight_update(self) -> None:
        """End an update through which nothing was sent (fleetrl's addition to vLLM's four calls)."""
        self._run(self.client.finish_engine_update(0, timeout_s=self.timeout_s, abort=True))

    def _run(self, coroutine: Coroutine[Any, Any, int]) -> int:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout_s + 20.0)
