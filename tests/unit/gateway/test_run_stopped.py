"""A gateway told the run stopped (the controller failed or was stopped, `run_stopped`) drops its rows in flight and
waits for a resumed controller instead of exiting 0 (issue 28, item 2); with none within `controller_lost_s` it
exits EXIT_CONTROLLER_LOST, which a supervisor does not restart.

Real gRPC controller stand-ins on loopback: the first leases a row whose rollout never ends, says run_stopped on the
next heartbeat and goes away; the second, started on the same port (a resumed controller), leases a row and then
says the run finished.
"""

from __future__ import annotations

import asyncio
import json

import grpc

from fleetrl import Config
from fleetrl.exit_codes import EXIT_CONTROLLER_LOST
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.worker import Gateway
from fleetrl.v1 import controller_pb2, controller_pb2_grpc
from tests.unit.gateway.test_lease_wait import make_rollout_fn


def leased(row_id: int) -> controller_pb2.LeasedRow:
    return controller_pb2.LeasedRow(row_id=row_id, submit_version=0, row_json=json.dumps({"q": row_id}), attempt=1)


class Stopping(controller_pb2_grpc.ControllerServicer):
    """Leases row 0, then says the run stopped (to heartbeats and lease calls alike)."""

    def __init__(self) -> None:
        self.leases = 0
        self.told = asyncio.Event()

    async def Register(self, request, context):
        return controller_pb2.RegisterResponse(heartbeat_interval_s=0.05, run_id="old")

    async def Heartbeat(self, request, context):
        self.told.set()
        return controller_pb2.HeartbeatResponse(known=True, run_stopped=True)

    async def LeaseRows(self, request, context):
        self.leases += 1
        if self.leases == 1:
            return controller_pb2.LeaseRowsResponse(rows=[leased(0)], replicas=[controller_pb2.Replica(address="x:1")])
        self.told.set()
        return controller_pb2.LeaseRowsResponse(run_stopped=True, retry_after_s=0.2)

    async def ReportRows(self, request, context):
        raise AssertionError("row 0 never ends: its task is dropped, not reported")


class Resumed(controller_pb2_grpc.ControllerServicer):
    """A controller resumed from the journal: row 0 again (attempt 2), then the run finishes once it is reported."""

    def __init__(self) -> None:
        self.reports: list[controller_pb2.RowReport] = []

    async def Register(self, request, context):
        return controller_pb2.RegisterResponse(heartbeat_interval_s=0.05, run_id="new")

    async def Heartbeat(self, request, context):
        return controller_pb2.HeartbeatResponse(known=False)  # a new process: register again

    async def LeaseRows(self, request, context):
        if not self.reports and not getattr(self, "_leased", False):
            self._leased = True
            row = controller_pb2.LeasedRow(row_id=0, submit_version=0, row_json=json.dumps({"q": 0}), attempt=2)
            return controller_pb2.LeaseRowsResponse(rows=[row], replicas=[controller_pb2.Replica(address="x:1")])
        return controller_pb2.LeaseRowsResponse(run_finished=bool(self.reports), retry_after_s=0.05)

    async def ReportRows(self, request, context):
        self.reports.extend(request.reports)
        return controller_pb2.ReportRowsResponse(results=["accepted"])


def first_call_hangs_then_plain(setup):
    """Row 0's first rollouts never end (the stopped controller's lease); later ones return at once."""
    plain = make_rollout_fn(setup)
    calls = {"n": 0}

    async def rollout(row):
        calls["n"] += 1
        if calls["n"] <= 2:  # the G = 2 rollouts of the first lease
            await asyncio.sleep(3600)
        return await plain(row)

    return rollout


async def serve(servicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def gateway(port: int, factory, **config) -> Gateway:
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    settings = GatewayConfig(run=run, rollout="unused:unused", controller_address=f"127.0.0.1:{port}", **config)
    return Gateway(settings, rollout_factory=factory)


async def test_a_gateway_told_the_run_stopped_waits_for_the_resumed_controller():
    old, port = await serve(stopping := Stopping())
    gw = gateway(port, first_call_hangs_then_plain, max_rows_in_flight=1, controller_lost_s=60)
    run = asyncio.create_task(gw.run())
    new = None
    try:
        await asyncio.wait_for(stopping.told.wait(), 20)
        await old.stop(None)  # the stopped controller is gone; the gateway keeps going (before: it exited 0)
        assert not run.done()
        new, _ = await serve(resumed := Resumed(), port)
        assert await asyncio.wait_for(run, 30) == 0  # finished by the resumed controller's reply
    finally:
        run.cancel()
        await old.stop(None)
        if new is not None:
            await new.stop(None)
    assert [(r.row_id, r.attempt) for r in resumed.reports] == [(0, 2)]  # the old attempt was dropped, not reported


async def test_with_no_resumed_controller_it_exits_controller_lost():
    old, port = await serve(stopping := Stopping())
    gw = gateway(port, first_call_hangs_then_plain, max_rows_in_flight=1, controller_lost_s=0.5)
    run = asyncio.create_task(gw.run())
    try:
        await asyncio.wait_for(stopping.told.wait(), 20)
        await old.stop(None)
        assert await asyncio.wait_for(run, 30) == EXIT_CONTROLLER_LOST  # not 0: a supervisor sees the run did not end
    finally:
        run.cancel()
        await old.stop(None)
