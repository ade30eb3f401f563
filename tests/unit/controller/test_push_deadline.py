"""The controller's LoadWeights deadline grows with the version's bytes (issue 27 item 7): a fixed
weight_push_timeout_s cut the push of a large model that the replica itself would have finished within its own,
byte-scaled bound. The trainer's replies carry the bytes (TrainStepResponse / PublishResponse.weights_bytes); a
push with them gives each LoadWeights weight_push_timeout_s plus the bytes at the conservative rate, and the
collective transport's fields when the run asks for it."""

from __future__ import annotations

import grpc
import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights.timeouts import MIN_TRANSFER_RATE_BYTES_PER_S, push_deadline_s


class RecordingReplica(inference_pb2_grpc.InferenceServicer):
    """Loads at once, recording each request and the time its caller gave it."""

    def __init__(self) -> None:
        self.requests: list[inference_pb2.LoadWeightsRequest] = []
        self.time_remaining: list[float] = []

    async def Status(self, request, context):
        return inference_pb2.StatusResponse(loaded_version=0)

    async def LoadWeights(self, request, context):
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        return inference_pb2.LoadWeightsResponse(version=request.version)


@pytest.fixture
async def replica():
    servicer = RecordingReplica()
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


def orchestrator(tmp_path, address: str, run: Config) -> Orchestrator:
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("inference", "inference-0", address, now=0)
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    config = ControllerConfig(run=run, rows_path="rows.jsonl", weight_push_timeout_s=10.0)
    return Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: 0.0)


async def test_the_load_deadline_grows_with_the_versions_bytes(tmp_path, replica):
    servicer, address = replica
    orch = orchestrator(tmp_path, address, Config())
    nbytes = 16 * 10**9  # an 8B model in bfloat16
    try:
        await orch.push_weights(1, "tcp://127.0.0.1:1", nbytes)
    finally:
        await orch.close()
    (request,) = servicer.requests
    assert request.timeout_s == 10.0  # the replica's floor; it adds the bytes itself
    assert request.transport == "" and request.group_replicas == 0
    # Before: 10 + 5 s whatever the size. Now the bytes three times at 100 MB/s on top (480 s for 16 GB).
    assert servicer.time_remaining[0] > 10.0 + 5 + 3 * nbytes / MIN_TRANSFER_RATE_BYTES_PER_S - 60


async def test_a_collective_run_asks_each_replica_for_the_collective_transport(tmp_path, replica):
    servicer, address = replica
    orch = orchestrator(tmp_path, address, Config(weight_transport="collective"))
    try:
        await orch.push_weights(1, "tcp://127.0.0.1:1", 1000)
    finally:
        await orch.close()
    (request,) = servicer.requests
    assert (request.transport, request.group_replicas) == ("collective", 1)


def test_push_deadline_adds_the_bytes_three_times_at_the_rate() -> None:
    assert push_deadline_s(300.0, 0) == 300.0
    assert push_deadline_s(300.0, 16 * 10**9) == pytest.approx(300.0 + 480.0)
