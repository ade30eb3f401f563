"""The evaluation hook in the current cookbook's shape, `evaluation_fn(step, rollout_fn)` (fw-ai/cookbook #570):
called with the step and the rollout function (evaluation=True), no eval_dataset needed. Before, every hook was
called as `(setup, rows)`, so a cookbook hook failed each time (eval/failed = 1). fleetrl's `(setup, rows)` shape
still works. A real gRPC controller stand-in on loopback asks for the evaluation."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from fleetrl import Config, RolloutSample, RolloutSetup
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.worker import Gateway
from fleetrl.rollout import evaluation_call_shape, make_evaluation_rollout_fn
from fleetrl.v1 import controller_pb2, controller_pb2_grpc
from tests.unit.gateway.test_lease_wait import Controller


class AsksForAnEvaluation(Controller):
    """Asks for an evaluation of version 3, finishes the run once it is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.evals: list[controller_pb2.ReportEvalRequest] = []

    async def LeaseRows(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            return controller_pb2.LeaseRowsResponse(evaluate_version=3, retry_after_s=0.2)
        await asyncio.wait_for(self.reported.wait(), 10.0)
        return controller_pb2.LeaseRowsResponse(run_finished=True)

    async def ReportEval(self, request, context):
        self.evals.append(request)
        self.reported.set()
        return controller_pb2.ReportEvalResponse()


def make_rollout_fn(setup: RolloutSetup):
    async def rollout_fn(row: dict, *, evaluation: bool, sample_index: int = 0) -> RolloutSample:
        reward = 1.0 if evaluation and row["q"] == 2 else 0.0  # evaluation=True reaches the rollout
        return RolloutSample([1, 2], [0.0, -0.5], [0, 1], reward + sample_index)

    return rollout_fn


async def run_evaluation(evaluation_fn: Any, **run: Any) -> controller_pb2.ReportEvalRequest:
    controller = AsksForAnEvaluation()
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = Config(base_model="unused", dataset="unused", completions_per_prompt=2, **run)
    settings = GatewayConfig(run=cfg, rollout="unused:unused", controller_address=f"127.0.0.1:{port}")
    gateway = Gateway(settings, rollout_factory=make_rollout_fn, evaluation_fn=evaluation_fn)
    try:
        assert await asyncio.wait_for(gateway.run(), 20.0) == 0
    finally:
        await server.stop(None)
    (report,) = controller.evals
    return report


async def test_a_cookbook_evaluation_fn_gets_the_step_and_the_rollout_function():
    steps: list[int] = []

    async def evaluation_fn(step: int, rollout_fn) -> dict[str, float]:
        steps.append(step)
        results = await asyncio.gather(*(rollout_fn({"q": q}, sample_index=0) for q in (1, 2)))
        return {"accuracy": sum(r.reward for r in results) / len(results)}

    report = await run_evaluation(evaluation_fn)  # no eval_dataset: the cookbook's hook owns its rows
    assert steps == [3] and report.version == 3
    assert report.metrics["accuracy"] == 0.5 and "failed" not in report.metrics


async def test_a_cookbook_evaluation_fn_may_return_none():
    async def evaluation_fn(step, rollout_fn):
        await rollout_fn({"q": 1})
        return None

    report = await run_evaluation(evaluation_fn)
    assert set(report.metrics) == {"seconds"}


async def test_fleetrls_setup_rows_shape_still_gets_the_held_out_rows(tmp_path):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text('{"q": 1}\n{"q": 2}\n')

    async def evaluate(setup, rows):
        return {"rows": len(rows), "has_setup": isinstance(setup, RolloutSetup)}

    report = await run_evaluation(evaluate, eval_dataset=str(held_out))
    assert (report.metrics["rows"], report.metrics["has_setup"]) == (2, 1.0)


async def test_the_evaluation_rollout_fn_passes_only_the_context_the_rollout_declares():
    seen: list[dict[str, Any]] = []

    async def rollout_fn(row: dict, *, evaluation: bool, row_index: int) -> None:
        seen.append({"evaluation": evaluation, "row_index": row_index})

    await make_evaluation_rollout_fn(rollout_fn)({"q": 1}, row_index=4, epoch=0, unknown=1)
    assert seen == [{"evaluation": True, "row_index": 4}]


def test_the_call_shape_is_read_from_the_signature():
    async def cookbook(step, rollout_fn): ...
    async def by_annotation(n: int, f): ...
    async def fleetrl_shape(setup, rows): ...
    async def annotated(s: RolloutSetup, r): ...

    assert evaluation_call_shape(cookbook) == evaluation_call_shape(by_annotation) == "step_rollout_fn"
    assert evaluation_call_shape(fleetrl_shape) == evaluation_call_shape(annotated) == "setup_rows"

    async def unclear(a, b): ...
    async def one(step): ...

    with pytest.raises(ValueError, match=r"evaluation_fn: cannot tell from its parameters \(a, b\)"):
        evaluation_call_shape(unclear)
    with pytest.raises(ValueError, match="evaluation_fn: it must take two positional arguments"):
        evaluation_call_shape(one)
