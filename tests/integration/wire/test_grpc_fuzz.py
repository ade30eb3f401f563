"""Adversarial requests to every gRPC method of the four servers (controller, trainer, inference, reference),
started in-process on loopback with auth on: raw bytes through the generic channel API (garbage, truncated,
deeply nested, oversize, without or with a wrong token, unknown methods) and well-typed requests with wrong values
(negative or huge counts, empty ids, unknown enums, NaN and infinite doubles). Each gets an error status (or a
harmless answer) and, after each, the server still answers a well-formed call."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from fleetrl import Config
from fleetrl.rpc import check_health, message_options, open_channel
from fleetrl.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    reference_pb2,
    reference_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

pytestmark = pytest.mark.integration

TOKEN = "s3cret"
NAN, INF = float("nan"), float("inf")
C = grpc.StatusCode

# (name, payload, credentials, expected status): sent raw to every method of a server.
# credentials: "token", "none" or "wrong". "OVERSIZE" is replaced by one byte more than the server's cap.
RAW_INPUTS: list[tuple[str, bytes, str, set[grpc.StatusCode]]] = [
    ("garbage", b"\xff\xff\xff garbage", "token", {C.INVALID_ARGUMENT}),
    ("truncated field", b"\x0a\x05ab", "token", {C.INVALID_ARGUMENT}),
    ("unterminated varint", b"\x08" + b"\xff" * 11, "token", {C.INVALID_ARGUMENT}),
    ("deeply nested protobuf groups", b"{" * 100_000, "token", {C.INVALID_ARGUMENT}),
    ("deeply nested JSON", b"[" * 100_000, "token", {C.INVALID_ARGUMENT}),
    ("oversize", b"OVERSIZE", "token", {C.RESOURCE_EXHAUSTED}),
    ("garbage without a token", b"\xff\xff\xff garbage", "none", {C.UNAUTHENTICATED}),
    ("deep nesting with a wrong token", b"{" * 100_000, "wrong", {C.UNAUTHENTICATED}),
    ("oversize without a token", b"OVERSIZE", "none", {C.RESOURCE_EXHAUSTED}),
]


def _metadata(credentials: str) -> tuple[tuple[str, str], ...]:
    return {"token": (("authorization", f"Bearer {TOKEN}"),), "wrong": (("authorization", "Bearer nope"),)}.get(
        credentials, ()
    )


async def _code(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return C.OK


async def _fuzz_raw(
    port: int, service: str, methods: list[str], cap_bytes: int, healthy: Callable[[], Awaitable[Any]]
) -> None:
    """Every RAW_INPUT to every method (and the health service), then the unknown method; after each, a healthy
    call must succeed."""
    options = message_options(max(cap_bytes >> 20, 1) * 4)  # the client may send more than the server takes
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        paths = [f"/fleetrl.v1.{service}/{m}" for m in methods] + ["/grpc.health.v1.Health/Check"]
        for path in paths:
            for name, payload, credentials, expected in RAW_INPUTS:
                data = b"\x00" * (cap_bytes + 1) if payload == b"OVERSIZE" else payload
                if path.startswith("/grpc.health") and credentials != "token":
                    expected = {C.INVALID_ARGUMENT} if expected == {C.UNAUTHENTICATED} else expected  # open
                call = channel.unary_unary(path)(data, metadata=_metadata(credentials), timeout=60)
                code = await _code(call)
                assert code in expected, f"{path} {name}: {code}"
                await healthy()
        code = await _code(channel.unary_unary(f"/fleetrl.v1.{service}/Nope")(b"", metadata=_metadata("token")))
        assert code == C.UNIMPLEMENTED
        assert await check_health(channel) == "SERVING"


async def _fuzz_typed(
    stub: Any, cases: list[tuple[str, str, Any, set[grpc.StatusCode]]], healthy: Callable[[], Awaitable[Any]]
) -> None:
    """Each (name, method, request, expected) in turn; after each, a healthy call must succeed."""
    for name, method, request, expected in cases:
        code = await _code(getattr(stub, method)(request, timeout=60))
        assert code in expected, f"{name}: {code}"
        await healthy()


# -- controller ------------------------------------------------------------------------------------------------


async def test_controller_survives_adversarial_requests(tmp_path):
    from fleetrl.services.controller.config import ControllerConfig
    from fleetrl.services.controller.server import create_server

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": i}) + "\n" for i in range(8)))
    run = Config(
        log_path=str(tmp_path / "run"),
        prompt_groups_per_step=2,
        completions_per_prompt=2,
        max_head_offpolicy_versions=1,
    )
    config = ControllerConfig(run=run, rows_path=str(rows), grpc_port=0, metrics_port=None, auth_token=TOKEN)
    ctl = create_server(config)
    await ctl.server.start()
    try:
        async with open_channel(f"127.0.0.1:{ctl.port}", TOKEN) as channel:
            stub = controller_pb2_grpc.ControllerStub(channel)

            async def healthy() -> None:
                status = await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=30)
                assert status.run_id

            methods = ["Register", "Heartbeat", "LeaseRows", "ReportRows", "GetStatus", "ReportEval"]
            await _fuzz_raw(ctl.port, "Controller", methods, 16 << 20, healthy)

            # Open leasing (a replica and a started run) so LeaseRows goes through the scheduler.
            await stub.Register(
                controller_pb2.RegisterRequest(kind=controller_pb2.INFERENCE, member_id="r0", address="x:1")
            )
            ctl.orchestrator.started = True
            Rep, Rows = controller_pb2.RowReport, controller_pb2.ReportRowsRequest
            R = controller_pb2.RegisterRequest
            cases = [
                ("Register an unknown kind", "Register", R(kind=99, member_id="m"), {C.INVALID_ARGUMENT}),
                ("Register no kind", "Register", R(member_id="m"), {C.INVALID_ARGUMENT}),
                ("Register an empty id", "Register", R(kind=controller_pb2.GATEWAY), {C.INVALID_ARGUMENT}),
                ("Register a replica without address", "Register", R(kind=2, member_id="r9"), {C.INVALID_ARGUMENT}),
                ("Heartbeat an empty id", "Heartbeat", controller_pb2.HeartbeatRequest(), {C.OK}),
                (
                    "LeaseRows no gateway",
                    "LeaseRows",
                    controller_pb2.LeaseRowsRequest(max_rows=2),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "LeaseRows -5 rows",
                    "LeaseRows",
                    controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=-5),
                    {C.OK},
                ),
                (
                    "LeaseRows 2**31-1 rows",
                    "LeaseRows",
                    controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=2**31 - 1),
                    {C.OK},
                ),
                (
                    "ReportRows an unknown outcome",
                    "ReportRows",
                    Rows(gateway_id="gw", reports=[Rep(row_id=0, outcome=99)]),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "ReportRows no outcome",
                    "ReportRows",
                    Rows(gateway_id="gw", reports=[Rep(row_id=0)]),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "ReportRows a row never leased",
                    "ReportRows",
                    Rows(gateway_id="gw", reports=[Rep(row_id=-1, outcome=1)]),
                    {C.OK},
                ),
                (
                    "ReportRows extreme ids and versions",
                    "ReportRows",
                    Rows(gateway_id="gw", reports=[Rep(row_id=2**63 - 1, outcome=3, attempt=-3, min_version=-(2**63))]),
                    {C.OK},
                ),
                (
                    "ReportRows another gateway's row",
                    "ReportRows",
                    Rows(gateway_id="intruder", reports=[Rep(row_id=0, outcome=1)]),
                    {C.OK},
                ),
                (
                    "ReportEval version -1",
                    "ReportEval",
                    controller_pb2.ReportEvalRequest(version=-1),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "ReportEval a future version",
                    "ReportEval",
                    controller_pb2.ReportEvalRequest(version=2**62),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "ReportEval NaN and inf metrics",
                    "ReportEval",
                    controller_pb2.ReportEvalRequest(version=0, metrics={"a": NAN, "b": INF}),
                    {C.OK},
                ),
            ]
            await _fuzz_typed(stub, cases, healthy)
            leased = sorted(ctl.scheduler.leases)
            assert len(leased) == 4  # the gate's capacity, not 2**31 - 1
            # Another gateway cannot report gw's rows: late, ignored.
            intruder = Rows(
                gateway_id="intruder", reports=[Rep(row_id=r, outcome=controller_pb2.ACCEPTED) for r in leased]
            )
            assert list((await stub.ReportRows(intruder)).results) == ["late"] * 4
            status = await stub.GetStatus(controller_pb2.GetStatusRequest())
            assert status.counters["rows_leased"] == 4 and status.counters.get("rows_accepted", 0) == 0
            assert sorted(ctl.scheduler.leases) == leased
    finally:
        await ctl.server.stop(0)
        ctl.journal.close()


# -- trainer ---------------------------------------------------------------------------------------------------


async def test_trainer_survives_adversarial_requests(tiny_model_dir, tmp_path):
    from fleetrl.services.trainer.config import TrainerServiceConfig
    from fleetrl.services.trainer.server import create_server
    from fleetrl.trainer import PolicyTrainer
    from tests.unit.trainer.helpers import make_cfg

    run = make_cfg(tiny_model_dir, tmp_path)
    config = TrainerServiceConfig(
        run=run, grpc_port=0, groups_port=0, weights_port=0, metrics_port=None, auth_token=TOKEN, max_message_mb=1
    )
    service = create_server(config, PolicyTrainer(run))
    await service.start()
    try:
        async with open_channel(f"127.0.0.1:{service.grpc_port}", TOKEN) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)

            async def healthy() -> None:
                status = await stub.Status(trainer_pb2.TrainerStatusRequest(), timeout=30)
                assert status.steps_done == 0

            methods = ["TrainStep", "Publish", "SaveCheckpoint", "Finish", "Status"]
            await _fuzz_raw(service.grpc_port, "Trainer", methods, 1 << 20, healthy)
            S, G = trainer_pb2.TrainStepRequest, trainer_pb2.GroupRef
            missing = [G(row_id=-1, attempt=-1)]
            cases = [
                ("TrainStep step -5", "TrainStep", S(step=-5), {C.OK}),
                ("TrainStep step 0", "TrainStep", S(step=0), {C.OK}),
                (
                    "TrainStep step 2**62",
                    "TrainStep",
                    S(step=2**62, superseded=[G(row_id=2**63 - 1)]),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "TrainStep missing groups",
                    "TrainStep",
                    S(step=1, groups=missing, wait_timeout_s=0.001),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "TrainStep negative wait",
                    "TrainStep",
                    S(step=1, groups=missing, wait_timeout_s=-1),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "TrainStep NaN wait",
                    "TrainStep",
                    S(step=1, groups=missing, wait_timeout_s=NAN),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "TrainStep infinite wait",
                    "TrainStep",
                    S(step=1, groups=missing, wait_timeout_s=INF),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "TrainStep deeply nested data_position",
                    "TrainStep",
                    S(step=1, data_position="[" * 100_000),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "TrainStep data_position not JSON",
                    "TrainStep",
                    S(step=1, data_position="{bad"),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "SaveCheckpoint deeply nested data_position",
                    "SaveCheckpoint",
                    trainer_pb2.SaveCheckpointRequest(data_position="[" * 100_000),
                    {C.INVALID_ARGUMENT},
                ),
                (
                    "Finish data_position not JSON",
                    "Finish",
                    trainer_pb2.FinishRequest(data_position="{bad"),
                    {C.INVALID_ARGUMENT},
                ),
            ]
            await _fuzz_typed(stub, cases, healthy)
        service.check()  # the group receiver and the weight publisher are fine too
    finally:
        await service.stop()


# -- inference -------------------------------------------------------------------------------------------------


async def test_inference_survives_adversarial_requests(tiny_model_dir):
    from fleetrl.services.inference.config import InferenceConfig
    from fleetrl.services.inference.hf_engine import HFEngine
    from fleetrl.services.inference.server import create_server

    config = InferenceConfig(
        model=tiny_model_dir,
        engine="hf",
        grpc_port=0,
        http_port=None,
        metrics_port=None,
        auth_token=TOKEN,
        max_message_mb=1,
    )
    service = create_server(config, HFEngine(tiny_model_dir))
    await service.start()
    try:
        async with open_channel(f"127.0.0.1:{service.grpc_port}", TOKEN) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def healthy() -> None:
                status = await stub.Status(inference_pb2.StatusRequest(), timeout=30)
                assert status.loaded_version == 0

            await _fuzz_raw(service.grpc_port, "Inference", ["Generate", "Status", "LoadWeights"], 1 << 20, healthy)
            Gen, L = inference_pb2.GenerateRequest, inference_pb2.LoadWeightsRequest
            bad = {C.INVALID_ARGUMENT}
            cases = [
                ("Generate an empty prompt", "Generate", Gen(), bad),
                ("Generate a token outside the vocabulary", "Generate", Gen(prompt_token_ids=[10**6]), bad),
                ("Generate a negative token", "Generate", Gen(prompt_token_ids=[-1]), bad),
                ("Generate n -1", "Generate", Gen(prompt_token_ids=[1], n=-1), bad),
                ("Generate n 2**31-1", "Generate", Gen(prompt_token_ids=[1], n=2**31 - 1), bad),
                ("Generate max_tokens -5", "Generate", Gen(prompt_token_ids=[1], max_tokens=-5), bad),
                ("Generate max_tokens 2**31-1", "Generate", Gen(prompt_token_ids=[1], max_tokens=2**31 - 1), bad),
                ("Generate a prompt longer than the model", "Generate", Gen(prompt_token_ids=[1] * 5000), bad),
                ("Generate NaN temperature", "Generate", Gen(prompt_token_ids=[1], temperature=NAN), bad),
                ("Generate infinite temperature", "Generate", Gen(prompt_token_ids=[1], temperature=INF), bad),
                ("Generate negative temperature", "Generate", Gen(prompt_token_ids=[1], temperature=-1), bad),
                ("Generate NaN top_p", "Generate", Gen(prompt_token_ids=[1], top_p=NAN), bad),
                ("Generate top_p 0", "Generate", Gen(prompt_token_ids=[1], top_p=0.0), bad),
                ("Generate top_k -1", "Generate", Gen(prompt_token_ids=[1], top_k=-1), bad),
                ("Generate seed 2**64-1", "Generate", Gen(prompt_token_ids=[1], seed=2**64 - 1), bad),
                (
                    "Generate a stop token outside the vocabulary",
                    "Generate",
                    Gen(prompt_token_ids=[1], stop_token_ids=[-1]),
                    bad,
                ),
                (
                    "LoadWeights version -1",
                    "LoadWeights",
                    L(version=-1, source="tcp://127.0.0.1:1"),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "LoadWeights an empty source",
                    "LoadWeights",
                    L(version=1, source="", timeout_s=1),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "LoadWeights a source that is no address",
                    "LoadWeights",
                    L(version=1, source="\x00../etc", timeout_s=1),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "LoadWeights nobody listening",
                    "LoadWeights",
                    L(version=1, source="tcp://127.0.0.1:1", timeout_s=0.3),
                    {C.FAILED_PRECONDITION},
                ),
                (
                    "LoadWeights NaN timeout",
                    "LoadWeights",
                    L(version=1, source="tcp://127.0.0.1:1", timeout_s=NAN),
                    bad,
                ),
                (
                    "LoadWeights negative timeout",
                    "LoadWeights",
                    L(version=1, source="tcp://127.0.0.1:1", timeout_s=-1),
                    bad,
                ),
            ]
            await _fuzz_typed(stub, cases, healthy)
            reply = await stub.Generate(Gen(prompt_token_ids=[1, 2], max_tokens=4, seed=1), timeout=60)
            assert len(reply.completions) == 1
    finally:
        await service.stop()


# -- reference -------------------------------------------------------------------------------------------------


async def test_reference_survives_adversarial_requests(tiny_model_dir):
    from fleetrl.services.reference.config import ReferenceConfig
    from fleetrl.services.reference.server import create_server

    config = ReferenceConfig(model=tiny_model_dir, grpc_port=0, metrics_port=None, auth_token=TOKEN, max_message_mb=1)
    service = create_server(config)
    await service.start()
    try:
        async with open_channel(f"127.0.0.1:{service.grpc_port}", TOKEN) as channel:
            stub = reference_pb2_grpc.ReferenceStub(channel)

            async def healthy() -> None:
                await stub.Status(reference_pb2.ReferenceStatusRequest(), timeout=30)

            await _fuzz_raw(service.grpc_port, "Reference", ["ComputeLogprobs", "Status"], 1 << 20, healthy)
            Req, Seq = reference_pb2.ComputeLogprobsRequest, reference_pb2.TokenSequence
            bad = {C.INVALID_ARGUMENT}
            cases = [
                ("one token", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1])]), bad),
                ("a negative token", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1, -1])]), bad),
                ("a token outside the vocabulary", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1, 2**62])]), bad),
                ("longer than the model", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1] * 5000)]), bad),
                ("NaN temperature", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1, 2])], temperature=NAN), bad),
                ("infinite temperature", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1, 2])], temperature=INF), bad),
                ("temperature 0", "ComputeLogprobs", Req(sequences=[Seq(tokens=[1, 2])], temperature=0.0), bad),
                ("no sequences", "ComputeLogprobs", Req(), {C.OK}),
            ]
            await _fuzz_typed(stub, cases, healthy)
            reply = await stub.ComputeLogprobs(Req(sequences=[Seq(tokens=[1, 2, 3])]), timeout=60)
            assert len(reply.sequences[0].logprobs) == 2
    finally:
        await service.stop()
