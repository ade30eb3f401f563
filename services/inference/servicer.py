"""The inference gRPC servicer (fleetrl.v1.Inference): a thin edge that converts protos to engine dataclasses and
engine errors to gRPC status codes.

    ValueError (a bad request)      -> INVALID_ARGUMENT
    WeightLoadError (a bad version) -> FAILED_PRECONDITION (the engine keeps serving the previous version)
    EngineError (engine down)       -> UNAVAILABLE

The engine-group calls (JoinEngineGroup, StartEngineUpdate, EngineUpdate, FinishEngineUpdate: a trainer-driven
update, fleetrl.weights.engine_sync) on an engine without them -> UNIMPLEMENTED; info that is not a JSON object ->
INVALID_ARGUMENT; a call past its timeout -> DEADLINE_EXCEEDED; a failed transfer -> ABORTED (the replica refuses
generation until a load succeeds, VLLMEngine.engine_update).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable
from typing import Any

import grpc

from fleetrl.clients.inference_proto import completions_to_proto, request_from_proto
from fleetrl.rpc import resolve_auth_token
from fleetrl.services.inference.engine import EngineError, InferenceEngine, WeightLoadError
from fleetrl.services.inference.metrics import InferenceMetrics
from fleetrl.services.inference.weight_relay import ReplicaRelay
from fleetrl.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """fleetrl.v1.Inference on top of an InferenceEngine.

    `auth_token` is the weight stream's token (None = $FLEETRL_AUTH_TOKEN, read at each load);
    `weight_load_timeout_s` applies to a LoadWeights request that names no timeout; `relay` (None: off) takes the
    loads that ask to be relayed (`LoadWeightsRequest.relay`).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        metrics: InferenceMetrics,
        *,
        weight_load_timeout_s: float,
        auth_token: str | None = None,
        relay: ReplicaRelay | None = None,
    ) -> None:
        self._engine = engine
        self._relay = relay
        self._metrics = metrics
        self._weight_load_timeout_s = weight_load_timeout_s
        self._auth_token = auth_token

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        try:
            async with self._metrics.track_request("grpc"):
                completions = await self._engine.generate(request_from_proto(request))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Generate: {exc}")
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Generate: {exc}")
        self._metrics.observe_completions(completions)
        return completions_to_proto(completions)

    async def Status(
        self, request: inference_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.StatusResponse:
        stats = self._engine.stats()
        return inference_pb2.StatusResponse(
            model=self._engine.model_path,
            engine=self._engine.engine_name,
            loaded_version=self._engine.loaded_version,
            loaded_checksum=self._engine.loaded_checksum,
            queue_depth=self._engine.queue_depth(),
            tokens_per_s=stats.tokens_per_s,
            generated_tokens=stats.generated_tokens,
            requests=stats.requests,
            relay_address="" if self._relay is None else self._relay.address,
            relay_version=0 if self._relay is None else self._relay.version,
            workers=self._engine.workers,
        )

    async def LoadWeights(
        self, request: inference_pb2.LoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.LoadWeightsResponse:
        timeout_s = request.timeout_s or self._weight_load_timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            message = f"LoadWeights: timeout_s must be a finite number > 0, got {timeout_s}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if request.transport not in ("", "zmq", "collective"):
            message = f"LoadWeights: transport must be 'zmq' or 'collective', got {request.transport!r}"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if request.transport == "collective" and (request.relay or request.group_replicas < 1):
            message = "LoadWeights: a collective load needs group_replicas >= 1 and no relay"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        relay = self._relay if request.relay else None
        if request.relay and relay is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadWeights: this replica serves no relay")
        auth_token = resolve_auth_token(self._auth_token)
        try:
            if relay is not None:
                result = await relay.load(
                    self._engine, request.version, request.source, auth_token=auth_token, timeout_s=timeout_s
                )
            else:
                group_replicas = request.group_replicas if request.transport == "collective" else 0
                result = await self._engine.load_weights(
                    request.version,
                    request.source,
                    auth_token=auth_token,
                    timeout_s=timeout_s,
                    group_replicas=group_replicas,
                )
        except WeightLoadError as exc:
            self._metrics.observe_load(None)
            logger.warning(
                "weight load of version %d from %s rejected (still serving version %d): %s",
                request.version,
                request.source,
                self._engine.loaded_version,
                exc,
            )
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"LoadWeights: {exc}")
        except EngineError as exc:
            self._metrics.observe_load(None)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"LoadWeights: {exc}")
        self._metrics.observe_load(result)
        logger.info(
            "loaded weights version %d (checksum %s) from %s%s: transfer %.3f s, pause %.4f s",
            result.version,
            result.checksum,
            request.source,
            " through the relay" if request.relay else f" ({result.transport})",
            result.transfer_s,
            result.pause_s,
        )
        return inference_pb2.LoadWeightsResponse(
            version=result.version,
            checksum=result.checksum,
            transfer_s=result.transfer_s,
            pause_s=result.pause_s,
            transport=result.transport,
        )

    # ----- an engine group: the trainer drives the replica's weight-transfer calls -----

    async def JoinEngineGroup(
        self, request: inference_pb2.JoinEngineGroupRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EngineCallResponse:
        engine = self._group_engine("join_engine_group")
        if engine is None:
            await self._unimplemented(context, "JoinEngineGroup")
        if not request.engine:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "JoinEngineGroup: engine is empty")
        init = await self._json_object(context, "JoinEngineGroup", "engine_init_json", request.engine_init_json)
        timeout_s = await self._timeout(context, "JoinEngineGroup", request.timeout_s)
        return await self._engine_call(
            context, "JoinEngineGroup", engine.join_engine_group(request.engine, init, timeout_s)
        )

    async def StartEngineUpdate(
        self, request: inference_pb2.StartEngineUpdateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EngineCallResponse:
        engine = self._group_engine("start_engine_update")
        if engine is None:
            await self._unimplemented(context, "StartEngineUpdate")
        return await self._engine_call(context, "StartEngineUpdate", engine.start_engine_update())

    async def EngineUpdate(
        self, request: inference_pb2.EngineUpdateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EngineCallResponse:
        engine = self._group_engine("engine_update")
        if engine is None:
            await self._unimplemented(context, "EngineUpdate")
        info = await self._json_object(context, "EngineUpdate", "update_info_json", request.update_info_json)
        timeout_s = await self._timeout(context, "EngineUpdate", request.timeout_s)
        return await self._engine_call(context, "EngineUpdate", engine.engine_update(request.version, info, timeout_s))

    async def FinishEngineUpdate(
        self, request: inference_pb2.FinishEngineUpdateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EngineCallResponse:
        engine = self._group_engine("finish_engine_update")
        if engine is None:
            await self._unimplemented(context, "FinishEngineUpdate")
        if request.abort:
            return await self._engine_call(context, "FinishEngineUpdate", engine.abort_engine_update())
        return await self._engine_call(context, "FinishEngineUpdate", engine.finish_engine_update(request.version))

    def _group_engine(self, method: str) -> Any:
        return self._engine if callable(getattr(self._engine, method, None)) else None

    async def _unimplemented(self, context: grpc.aio.ServicerContext, call: str) -> None:
        message = f"{call}: the {self._engine.engine_name} engine has no engine-group updates (vLLM replicas only)"
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

    async def _timeout(self, context: grpc.aio.ServicerContext, call: str, timeout_s: float) -> float:
        timeout_s = timeout_s or self._weight_load_timeout_s
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{call}: timeout_s must be a finite number > 0, got {timeout_s}"
            )
        return timeout_s

    @staticmethod
    async def _json_object(context: grpc.aio.ServicerContext, call: str, field: str, text: str) -> dict[str, Any]:
        try:
            value = json.loads(text or "{}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call}: {field} is not JSON ({exc})")
        if not isinstance(value, dict):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{call}: {field} must be a JSON object, got {type(value).__name__}"
            )
        return value

    async def _engine_call(
        self, context: grpc.aio.ServicerContext, call: str, work: Awaitable[None]
    ) -> inference_pb2.EngineCallResponse:
        try:
            await work
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{call}: {exc}")
        except EngineError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{call}: {exc}")
        except TimeoutError as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{call}: timed out ({exc!r})")
        except Exception as exc:  # a failed transfer: the engine has already resumed and flagged itself
            logger.warning("%s failed: %r", call, exc)
            await context.abort(grpc.StatusCode.ABORTED, f"{call}: {exc!r}")
        return inference_pb2.EngineCallResponse(loaded_version=self._engine.loaded_version)
