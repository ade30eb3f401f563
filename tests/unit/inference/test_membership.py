"""The register-and-heartbeat loop of a member that joins by itself (fleetrl.inference.membership), against a scripted
controller: no sockets."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from fleetrl.inference.membership import stay_registered
from fleetrl.v1 import controller_pb2


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")


class ScriptedController:
    """Answers each call with the next scripted reply (or raises it); sets `stop` when the script is done."""

    def __init__(self, script: list, stop: asyncio.Event) -> None:
        self.script, self.stop, self.calls = list(script), stop, []

    async def _answer(self, name: str, request, timeout: float | None):
        assert timeout is not None and timeout > 0  # every call has a deadline
        self.calls.append((name, request.member_id))
        reply = self.script.pop(0)
        if not self.script:
            self.stop.set()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def Register(self, request, timeout=None):
        assert request.kind == controller_pb2.INFERENCE and request.address == "h:7"
        return await self._answer("Register", request, timeout)

    async def Heartbeat(self, request, timeout=None):
        return await self._answer("Heartbeat", request, timeout)


def run(script: list) -> ScriptedController:
    async def main() -> ScriptedController:
        stop = asyncio.Event()
        controller = ScriptedController(script, stop)
        await asyncio.wait_for(stay_registered(controller, "inference", "inference-0", "h:7", stop=stop, retry_s=0), 10)
        return controller

    return asyncio.run(main())


def registered(interval: float = 0.0) -> controller_pb2.RegisterResponse:
    return controller_pb2.RegisterResponse(heartbeat_interval_s=interval, run_id="r")


def test_it_registers_then_heartbeats():
    known = controller_pb2.HeartbeatResponse(known=True)
    controller = run([registered(), known, known])
    assert [c[0] for c in controller.calls] == ["Register", "Heartbeat", "Heartbeat"]
    assert {c[1] for c in controller.calls} == {"inference-0"}


def test_a_restarted_controller_that_does_not_know_it_gets_a_new_registration():
    known, unknown = controller_pb2.HeartbeatResponse(known=True), controller_pb2.HeartbeatResponse(known=False)
    controller = run([registered(), known, unknown, registered(), known])
    assert [c[0] for c in controller.calls] == ["Register", "Heartbeat", "Heartbeat", "Register", "Heartbeat"]


def test_failures_are_retried_and_logged_once_per_run_of_failures(caplog: pytest.LogCaptureFixture):
    known = controller_pb2.HeartbeatResponse(known=True)
    script = [unavailable(), unavailable(), registered(), unavailable(), unavailable(), known]
    with caplog.at_level(logging.DEBUG, logger="fleetrl.inference.membership"):
        controller = run(script)
    # A controller not up yet, then one that stops answering for a while: never fatal, registered once.
    assert [c[0] for c in controller.calls] == [
        "Register",
        "Register",
        "Register",
        "Heartbeat",
        "Heartbeat",
        "Heartbeat",
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "Register" in warnings[0] and "Heartbeat" in warnings[1]
    assert "UNAVAILABLE" in warnings[0]
