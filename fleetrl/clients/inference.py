"""`InferenceClient`: the async Python client of the inference server's gRPC API (fleetrl.v1.Inference).

    async with InferenceClient("127.0.0.1:50051") as client:     # token from $FLEETRL_AUTH_TOKEN
        completions = await client.generate(SamplingRequest([1, 2, 3], n=4, max_tokens=32))
        result = await client.load_weights(7, "tcp://127.0.0.1:5555")

A trainer drives a vLLM replica's weight-transfer engine group through join_engine_group, start_engine_update,
engine_update and finish_engine_update (fleetrl/clients/inference_engine.py: the same calls as vLLM's
VLLMWeightSyncClient, for fleetrl.weights.vllm_gloo's trainer engine).

Errors are grpc.aio.AioRpcError: INVALID_ARGUMENT (bad request), FAILED_PRECONDITION (weights refused),
UNAVAILABLE (engine down), UNAUTHENTICATED (token).
"""

from __future__ import annotations

import json
from typing import Any

from fleetrl.clients.inference_proto import completions_from_proto, request_to_proto
from fleetrl.clients.inference_types import Completion, LoadResult, SamplingRequest
from fleetrl.rpc import DEFAULT_MAX_MESSAGE_MB, open_channel
from fleetrl.v1 import inference_pb2, inference_pb2_grpc


class InferenceClient:
    """One channel to one inference server; every call has a timeout."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 600.0,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, auth_token, max_message_mb=max_message_mb)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def generate(
        self, request: SamplingRequest, *, timeout_s: float | None = None, request_id: str = ""
    ) -> list[Completion]:
        reply = await self._stub.Generate(request_to_proto(request, request_id), timeout=timeout_s or self.timeout_s)
        return completions_from_proto(reply)

    async def status(self, *, timeout_s: float = 10.0) -> inference_pb2.StatusResponse:
        return await self._stub.Status(inference_pb2.StatusRequest(), timeout=timeout_s)

    async def load_weights(
        self, version: int, source: str, *, timeout_s: float = 300.0, group_replicas: int = 0
    ) -> LoadResult:
        """LoadWeights; `group_replicas` > 0 asks for the collective transport (that many replicas pushed to)."""
        msg = inference_pb2.LoadWeightsRequest(version=version, source=source, timeout_s=timeout_s)
        if group_replicas > 0:
            msg.transport, msg.group_replicas = "collective", group_replicas
        reply = await self._stub.LoadWeights(msg, timeout=timeout_s + 10.0)
        return LoadResult(reply.version, reply.checksum, reply.transfer_s, reply.pause_s, reply.transport or "zmq")

    # ----- a trainer-driven update through a weight-transfer engine group (vLLM replicas) -----

    async def join_engine_group(self, engine: str, engine_init: dict[str, Any], *, timeout_s: float = 120.0) -> int:
        """JoinEngineGroup: the replica's workers join `engine`'s group (init info `engine_init`); the version
        the replica serves."""
        msg = inference_pb2.JoinEngineGroupRequest(
            engine=engine, engine_init_json=json.dumps(engine_init), timeout_s=timeout_s
        )
        return (await self._stub.JoinEngineGroup(msg, timeout=timeout_s + 10.0)).loaded_version

    async def start_engine_update(self, *, timeout_s: float = 120.0) -> int:
        """StartEngineUpdate: pause generation and start an update (the replica ends it itself if the next call
        does not come within its engine_update_lease_s)."""
        reply = await self._stub.StartEngineUpdate(inference_pb2.StartEngineUpdateRequest(), timeout=timeout_s)
        return reply.loaded_version

    async def engine_update(self, version: int, update_info: dict[str, Any], *, timeout_s: float = 120.0) -> int:
        """EngineUpdate: receive `version` through the group (the trainer sends meanwhile)."""
        msg = inference_pb2.EngineUpdateRequest(
            version=version, update_info_json=json.dumps(update_info), timeout_s=timeout_s
        )
        return (await self._stub.EngineUpdate(msg, timeout=timeout_s + 10.0)).loaded_version

    async def finish_engine_update(self, version: int, *, timeout_s: float = 120.0, abort: bool = False) -> int:
        """FinishEngineUpdate: label new tokens `version` and resume generation; the version now served. `abort`:
        nothing was sent, end the update keeping the version served before."""
        msg = inference_pb2.FinishEngineUpdateRequest(version=version, abort=abort)
        return (await self._stub.FinishEngineUpdate(msg, timeout=timeout_s)).loaded_version

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
