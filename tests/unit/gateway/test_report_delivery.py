"""A row report or an evaluation report lost to a transient gRPC error is sent again until the controller answers
(issue 28, item 1): before, `Gateway._call` returned None and the row kept its gate reservation until its lease
expired (600 s by default: with O = 0 the step stalled for ten minutes), and a lost evaluation was never written.

A real gRPC controller stand-in on loopback fails the first report with UNAVAILABLE (or DEADLINE_EXCEEDED), as a
controller restarting or overloaded does, and answers the next.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from fleetrl import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.worker import ControllerLost, Gateway
from fleetrl.v1 import controller_pb2, controller_pb2_grpc
from tests.unit.gateway.test_lease_wait import Controller, make_rollout_fn, run_against


class FlakyReports(Controller):
    """The first ReportRows fails with `code`; the run finishes once a report got through."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__()
        self.code = code
        self.reports: list[controller_pb2.ReportRowsRequest] = []

    async def ReportRows(self, request, context):
        self.reports.append(request)
        if len(self.reports) == 1:
            await context.abort(self.code, "controller restarting")
        self.reported.set()
        return controller_pb2.ReportRowsResponse(results=["accepted"])


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_a_row_report_lost_to_a_transient_error_is_sent_again(code):
    controller = FlakyReports(code)
    gateway = await run_against(controller, make_rollout_fn, lease_wait_s=0.5)
    assert len(controller.reports) == 2  # before: one, never sent again (the row waited for its lease to expire)
    first, second = (r.reports[0] for r in controller.reports)
    assert first == second and first.attempt == 1  # the same report, naming its attempt: a repeat is a no-op
    # (rows_done is not asserted: the stand-in's held "run finished" lease reply may reach the gateway before the
    # second report's reply does, and the gateway then exits without counting the row done.)
    assert gateway.counters["reports_retried"] == 1


class FlakyEval(Controller):
    """Asks for an evaluation of version 0; the first ReportEval fails, the run finishes once one got through."""

    def __init__(self) -> None:
        super().__init__()
        self.evals: list[controller_pb2.ReportEvalRequest] = []

    async def LeaseRows(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            return controller_pb2.LeaseRowsResponse(evaluate_version=0, retry_after_s=0.2)
        await asyncio.wait_for(self.reported.wait(), 10.0)
        self.told.set()
        return controller_pb2.LeaseRowsResponse(run_finished=True)

    async def ReportEval(self, request, context):
        self.evals.append(request)
        if len(self.evals) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "controller restarting")
        self.reported.set()
        return controller_pb2.ReportEvalResponse()


async def evaluate(setup, rows):
    return {"accuracy": 0.5}


async def test_an_evaluation_report_lost_to_a_transient_error_is_sent_again(tmp_path):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"q": 1}) + "\n")
    controller = FlakyEval()
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    run = Config(base_model="unused", dataset="unused", eval_dataset=str(held_out), completions_per_prompt=2)
    settings = GatewayConfig(run=run, rollout="unused:unused", controller_address=f"127.0.0.1:{port}")
    gateway = Gateway(settings, rollout_factory=make_rollout_fn, evaluation_fn=evaluate)
    try:
        assert await asyncio.wait_for(gateway.run(), 20.0) == 0
    finally:
        await server.stop(None)
    assert [e.version for e in controller.evals] == [0, 0]  # before: one, lost
    assert controller.evals[1].metrics["accuracy"] == 0.5


class DeadController(Controller):
    async def ReportRows(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")


async def test_a_report_is_not_retried_past_controller_lost_s():
    controller = DeadController()
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    settings = GatewayConfig(
        run=run, rollout="unused:unused", controller_address=f"127.0.0.1:{port}", controller_lost_s=0.5
    )
    stub = controller_pb2_grpc.ControllerStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    gateway = Gateway(settings, rollout_factory=make_rollout_fn, controller=stub)
    gateway.report_retry_s = 0.05
    await gateway.prepare_rollouts()
    leased = controller_pb2.LeasedRow(row_id=0, submit_version=0, row_json=json.dumps({"q": 1}), attempt=1)
    try:
        with pytest.raises(ControllerLost):
            await asyncio.wait_for(gateway.process_row(leased), 20.0)
    finally:
        await server.stop(None)
