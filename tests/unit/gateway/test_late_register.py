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


async def test_a_gateway_says_it_started_only_once_a_controller_answered(caplog, free_port):
    """ "started (controller ...)" is what operators and the compose test read as "joined the run": a gateway whose
    controller is not there (not started yet, or already gone) says it is waiting instead, and joins on the first
    answer."""
    from fleetrl.exit_codes import EXIT_CONTROLLER_LOST

    caplog.set_level("INFO", logger="fleetrl.gateway.worker")
    gw = gateway(free_port, make_rollout_fn, controller_lost_s=0.5)
    assert await asyncio.wait_for(gw.run(), 30) == EXIT_CONTROLLER_LOST
    assert "no answer from the controller" in caplog.text and "started (controller" not in caplog.text

    caplog.clear()
    server, port = await serve(FinishedThenGone())
    try:
        assert await asyncio.wait_for(gateway(port, make_rollout_fn).run(), 30) == 0
    finally:
        await server.stop(None)
    assert "started (controller" in caplog.text and "no answer" not in caplog.text
