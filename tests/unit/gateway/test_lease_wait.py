"""The gateway's held lease calls (issue 19): it asks the controller to hold LeaseRows until rows are leasable
(`lease_wait_s`), and a reply saying the run finished ends it even when that reply came back while its last rows
were finishing: the controller counts that reply as having told the gateway and may be gone by the next call.

A real gRPC controller stand-in on loopback: the first lease gives one row; the next call (held, as a real
controller holds it) answers run_finished once the row is reported, and the server then stops. The report's own
reply waits until the gateway has exited, so the row's task is still running when the finished reply comes: an
order the stand-in sets with events, not one a delay makes likely.
"""

from __future__ import annotations

import asyncio
import json

import grpc

from fleetrl import Config, RolloutSample
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.worker import Gateway
from fleetrl.v1 import controller_pb2, controller_pb2_grpc


class Controller(controller_pb2_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.requests: list[controller_pb2.LeaseRowsRequest] = []
        self.reported = asyncio.Event()
        self.told = asyncio.Event()
        self.gateway_exited = asyncio.Event()

    async def Register(self, request, context):
        return controller_pb2.RegisterResponse(heartbeat_interval_s=2.0, run_id="r")

    async def Heartbeat(self, request, context):
        return controller_pb2.HeartbeatResponse(known=True)

    async def LeaseRows(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            row = controller_pb2.LeasedRow(row_id=0, submit_version=0, row_json=json.dumps({"q": 1}), attempt=1)
            return controller_pb2.LeaseRowsResponse(rows=[row], replicas=[controller_pb2.Replica(address="x:1")])
        await asyncio.wait_for(self.reported.wait(), 10.0)  # held until the row's outcome is in, then: finished
        self.told.set()
        return controller_pb2.LeaseRowsResponse(run_finished=True, retry_after_s=0.2)

    async def ReportRows(self, request, context):
        self.reported.set()
        await asyncio.wait_for(self.gateway_exited.wait(), 30.0)  # the row's task waits for this reply meanwhile
        return controller_pb2.ReportRowsResponse(results=["failed"])


async def run_against(controller: Controller, rollout_factory, **config) -> Gateway:
    """Serve `controller` on loopback, run a gateway against it until it exits (it must exit 0 within 20 s), and
    stop the server as the real controller does once it has told the gateway the run finished."""
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    settings = GatewayConfig(run=run, rollout="unused:unused", controller_address=f"127.0.0.1:{port}", **config)
    gateway = Gateway(settings, rollout_factory=rollout_factory)

    async def stop_once_told():
        await controller.told.wait()
        await server.stop(grace=0.5)

    stopper = asyncio.create_task(stop_once_told())
    try:
        assert await asyncio.wait_for(gateway.run(), 20.0) == 0  # before either fix: retried a gone controller
    finally:
        controller.gateway_exited.set()
        if not controller.told.is_set():  # the gateway failed or hung: do not wait for a reply never sent
            stopper.cancel()
        await asyncio.gather(stopper, return_exceptions=True)
        await server.stop(None)
    return gateway


def make_rollout_fn(setup):
    async def rollout(row):
        return RolloutSample(tokens=[1, 2], logprobs=[0.0, -0.5], loss_mask=[0, 1], reward=1.0, versions=[0, 0])

    return rollout


async def test_the_gateway_holds_its_lease_calls_and_exits_on_the_finished_reply_alone():
    controller = Controller()
    gateway = await run_against(controller, make_rollout_fn, lease_wait_s=0.5)
    assert [r.wait_s for r in controller.requests] == [0.5, 0.5]
    assert controller.reported.is_set()
    assert gateway.counters["rows_done"] == 0  # its task still waited for the report's reply: cancelled at the exit


class HeartbeatTellsController(Controller):
    """Leases one row whose rollout never ends (the gateway is busy, so it heartbeats instead of leasing); the
    heartbeat reply says the run finished, and the server stops: no later call would be answered."""

    async def Register(self, request, context):
        return controller_pb2.RegisterResponse(heartbeat_interval_s=0.1, run_id="r")

    async def Heartbeat(self, request, context):
        self.told.set()
        return controller_pb2.HeartbeatResponse(known=True, run_finished=True)

    async def LeaseRows(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            row = controller_pb2.LeasedRow(row_id=0, submit_version=0, row_json=json.dumps({"q": 1}), attempt=1)
            return controller_pb2.LeaseRowsResponse(rows=[row], replicas=[controller_pb2.Replica(address="x:1")])
        return controller_pb2.LeaseRowsResponse(run_finished=True)


def make_endless_rollout_fn(setup):
    async def rollout(row):
        await asyncio.sleep(3600)

    return rollout


async def test_a_busy_gateway_exits_on_a_heartbeat_reply_saying_the_run_finished():
    # The controller counts a heartbeat reply as telling the gateway too (told_if_finished) and may stop right after
    # it: a gateway that went on to call LeaseRows retried a gone controller (a compose CI run waited 30 s for it).
    controller = HeartbeatTellsController()
    await run_against(controller, make_endless_rollout_fn, max_rows_in_flight=1)
    assert len(controller.requests) == 1  # no lease call after the heartbeat said the run finished
