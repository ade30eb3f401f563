"""A gateway that registers after the run finished exits 0 on the register reply: the controller counts that
reply as having told it and may be gone before the gateway's next call (a compose run saw the controller exit
140 ms after a slow gateway registered, and the gateway retried the gone controller until it gave up).

A real gRPC controller stand-in on loopback whose every call after Register fails as a gone controller would."""

from __future__ import annotations

import asyncio

import grpc

from fleetrl.v1 import controller_pb2, controller_pb2_grpc
from tests.unit.gateway.test_lease_wait import make_rollout_fn
from tests.unit.gateway.test_run_stopped import gateway, serve


class FinishedThenGone(controller_pb2_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.calls_after_register: list[str] = []

    async def Register(self, request, context):
        return controller_pb2.RegisterResponse(heartbeat_interval_s=0.05, run_id="r", run_finished=True)

    async def _gone(self, name: str, context) -> None:
        self.calls_after_register.append(name)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the controller has exited")

    async def Heartbeat(self, request, context):
        await self._gone("Heartbeat", context)

    async def LeaseRows(self, request, context):
        await self._gone("LeaseRows", context)

    async def ReportRows(self, request, context):
        await self._gone("ReportRows", context)


async def test_a_gateway_registering_after_the_run_finished_exits_0_at_once():
    server, port = await serve(controller := FinishedThenGone())
    gw = gateway(port, make_rollout_fn, controller_lost_s=1.0)
    try:
        assert await asyncio.wait_for(gw.run(), 30) == 0  # before: EXIT_CONTROLLER_LOST after controller_lost_s
    finally:
        await server.stop(None)
    assert controller.calls_after_register == []
