"""The engine-group gRPC calls on a replica whose engine has none (the hf engine; here the scripted one): each of
the four answers UNIMPLEMENTED naming the call and the engine, over a real gRPC server."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from fleetrl.clients.inference import InferenceClient
from fleetrl.rpc import create_grpc_server
from fleetrl.services.inference.metrics import InferenceMetrics
from fleetrl.services.inference.servicer import InferenceServicer
from fleetrl.v1 import inference_pb2_grpc
from tests.unit.inference.fakes import ScriptedEngine


async def test_an_engine_without_engine_groups_answers_unimplemented() -> None:
    engine = ScriptedEngine()
    servicer = InferenceServicer(engine, InferenceMetrics(CollectorRegistry(), engine), weight_load_timeout_s=30.0)
    server, port = create_grpc_server([lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s)])
    await server.start()
    try:
        async with InferenceClient(f"127.0.0.1:{port}", timeout_s=30.0) as client:
            calls = {
                "JoinEngineGroup": lambda: client.join_engine_group("fleetrl_gloo", {}, timeout_s=10),
                "StartEngineUpdate": lambda: client.start_engine_update(timeout_s=10),
                "EngineUpdate": lambda: client.engine_update(1, {"version": 1}, timeout_s=10),
                "FinishEngineUpdate": lambda: client.finish_engine_update(1, timeout_s=10),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call()
                assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
                assert raised.value.details().startswith(f"{name}: the fake engine has no engine-group updates")
    finally:
        await server.stop(grace=None)
