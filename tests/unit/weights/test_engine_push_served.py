"""The engine push's stream fallback counts a replica that already serves the version as served (issue 39 item 3).

A broadcast can fail after one replica finished its update, without the failure naming it (`served` lists only
the replicas the engine knows finished). The fallback then asks that replica to load the version over the stream;
the replica refuses ("not newer than the loaded version"), and before this the pusher raised, so `EngineSync`
dropped a healthy replica that served exactly the version pushed. Real gRPC to a replica that answers Status and
LoadWeights as an engine that already serves the version does."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights.engine_push import EnginePusher, EngineTarget

pytest.importorskip("vllm")  # EnginePusher's transport is the fleetrl_gloo engine (fleetrl.weights.vllm_gloo)


class ServingReplica(inference_pb2_grpc.InferenceServicer):
    """Serves version `loaded`; refuses any load that is not newer, as the engines do."""

    def __init__(self, loaded: int) -> None:
        self.loaded = loaded
        self.loads: list[int] = []

    def Status(self, request, context):
        return inference_pb2.StatusResponse(loaded_version=self.loaded, engine="vllm", workers=1)

    def LoadWeights(self, request, context):
        self.loads.append(request.version)
        if request.version <= self.loaded:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {request.version} is not newer than the loaded version {self.loaded}",
            )
        return inference_pb2.LoadWeightsResponse(version=request.version)


@pytest.fixture
def replica():
    servicer = ServingReplica(loaded=3)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_a_replica_that_already_serves_the_version_counts_as_served_not_failed(replica):
    servicer, address = replica
    pusher = EnginePusher(lambda version: {}, "tcp://127.0.0.1:1", timeout_s=5.0, load_timeout_s=5.0)
    try:
        pusher._add_client(EngineTarget("inference-0", address))
        pusher.transport.stream_load("inference-0", 3)  # refused by the replica, which serves 3: served
        assert servicer.loads == [3]
        servicer.loaded = 5  # a refusal from a replica that does not serve the version stands
        with pytest.raises(grpc.RpcError, match="not newer"):
            pusher.transport.stream_load("inference-0", 4)
    finally:
        pusher.close()
