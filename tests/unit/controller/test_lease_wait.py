"""A LeaseRows call with `wait_s` is held until rows are leasable (issue 19: no 0.2 s poll between a step's
weight push and the next rollouts), and never longer than asked, the cap, or the run.

The controller's servicer is called directly (no sockets) with the scheduler, registry and orchestrator it runs with;
`fleetrl.controller.lease_signal.LeaseSignal` is tested on its own.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.lease_signal import LeaseSignal
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller import servicer as servicer_module
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2
from tests.waiting import async_wait_until

NOW = 1000.0


class Context:
    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def make(tmp_path) -> tuple[ControllerServicer, Orchestrator]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("inference", "inference-0", "127.0.0.1:1", NOW)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: NOW)
    servicer = ControllerServicer(scheduler, members, orch, run_id="r", heartbeat_interval_s=2.0, clock=lambda: NOW)
    return servicer, orch


def request(wait_s: float, max_rows: int = 4) -> controller_pb2.LeaseRowsRequest:
    return controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=max_rows, wait_s=wait_s)


async def test_a_held_call_leases_as_soon_as_leasing_opens(tmp_path, monkeypatch):
    monkeypatch.setattr(servicer_module, "LEASE_RECHECK_S", 30.0)  # only the notification can wake it
    servicer, orch = make(tmp_path)
    call = asyncio.create_task(servicer.LeaseRows(request(wait_s=5.0), Context()))
    await async_wait_until(lambda: orch.lease_signal.waiting == 1, 5.0, "the call held on the lease signal")
    assert not call.done()  # nothing leasable: held, not answered "retry later"
    orch.started = True
    orch.lease_signal.notify()
    reply = await asyncio.wait_for(call, 2.0)
    assert len(reply.rows) == 4 and reply.retry_after_s == 0


async def test_a_held_call_sees_an_unsignalled_change_at_the_next_recheck(tmp_path, monkeypatch):
    monkeypatch.setattr(servicer_module, "LEASE_RECHECK_S", 0.02)
    servicer, orch = make(tmp_path)
    call = asyncio.create_task(servicer.LeaseRows(request(wait_s=5.0), Context()))
    await async_wait_until(lambda: orch.lease_signal.waiting == 1, 5.0, "the call held on the lease signal")
    orch.started = True  # no notify
    reply = await asyncio.wait_for(call, 2.0)
    assert len(reply.rows) == 4


async def test_a_held_call_with_nothing_leasable_answers_empty_after_wait_s_and_says_ask_again(tmp_path):
    servicer, _ = make(tmp_path)
    started = time.monotonic()
    reply = await asyncio.wait_for(servicer.LeaseRows(request(wait_s=0.15), Context()), 5.0)
    assert time.monotonic() - started >= 0.15
    assert list(reply.rows) == [] and reply.retry_after_s == 0  # it waited already: the gateway asks again at once
    assert [r.member_id for r in reply.replicas] == ["inference-0"]


async def test_the_run_finishing_answers_a_held_call_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(servicer_module, "LEASE_RECHECK_S", 30.0)
    servicer, orch = make(tmp_path)
    call = asyncio.create_task(servicer.LeaseRows(request(wait_s=5.0), Context()))
    await async_wait_until(lambda: orch.lease_signal.waiting == 1, 5.0, "the call held on the lease signal")
    orch.finished = orch.completed = True  # run() ended after finish()
    orch.lease_signal.notify()
    reply = await asyncio.wait_for(call, 2.0)
    assert reply.run_finished and list(reply.rows) == []
    assert reply.retry_after_s > 0  # not a held-call answer: a gateway finishing its rows does not spin


@pytest.mark.parametrize("wait_s", [0.0, -1.0, float("nan")])
async def test_no_wait_or_a_bad_wait_answers_at_once_as_before(tmp_path, wait_s):
    servicer, _ = make(tmp_path)
    reply = await asyncio.wait_for(servicer.LeaseRows(request(wait_s=wait_s), Context()), 1.0)
    assert list(reply.rows) == [] and reply.retry_after_s > 0


async def test_a_call_asking_for_no_rows_is_never_held(tmp_path):
    servicer, _ = make(tmp_path)
    reply = await asyncio.wait_for(servicer.LeaseRows(request(wait_s=5.0, max_rows=0), Context()), 1.0)
    assert list(reply.rows) == []


async def test_wait_s_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(servicer_module, "MAX_LEASE_WAIT_S", 0.1)
    servicer, _ = make(tmp_path)
    reply = await asyncio.wait_for(servicer.LeaseRows(request(wait_s=float("inf")), Context()), 2.0)
    assert list(reply.rows) == []


async def test_lease_signal_wakes_every_current_waiter_once():
    signal = LeaseSignal()
    waiters = [asyncio.create_task(signal.wait(5.0)) for _ in range(3)]
    await async_wait_until(lambda: signal.waiting == 3, 5.0, "three waiters")
    signal.notify()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 1.0) == [True, True, True]
    assert await signal.wait(0.01) is False  # a later waiter waits for the next notification
    assert await signal.wait(0) is False


async def test_max_leased_leases_the_gateways_free_capacity_when_the_call_is_answered(tmp_path):
    """A call asking for 1 row with capacity 4 gets 4 once its earlier rows were reported: a held call that wakes
    when the gate opens leases what the gateway can take then, not what it could take when it asked."""
    servicer, orch = make(tmp_path)
    orch.started = True
    first = await servicer.LeaseRows(request(wait_s=0.0, max_rows=2), Context())
    assert len(first.rows) == 2 and servicer.scheduler.leased_to("gw") == 2
    capped = controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=1, max_leased=3)
    assert len((await servicer.LeaseRows(capped, Context())).rows) == 1  # 3 - 2 still leased
    for row in first.rows:
        servicer.scheduler.report(row.row_id, "failed", NOW, "gw", 0, row.attempt)  # requeued: the gate has room
    assert servicer.scheduler.leased_to("gw") == 1
    again = controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=1, max_leased=3)
    assert len((await servicer.LeaseRows(again, Context())).rows) == 2  # 3 - 1
    assert servicer.scheduler.leased_to("other") == 0


async def test_a_gateway_that_goes_away_during_a_held_call_is_leased_nothing(tmp_path, monkeypatch):
    """Over real gRPC: the gateway's held call is cancelled (it died or hung up) while the controller holds it;
    when the gate then opens, no row is leased to it. gRPC cancels the held handler, so it never leases rows nobody
    would receive: the test sees the call held on the controller, the handler end cancelled, and then nothing leased
    once leasing opens (a handler that swallowed the cancellation and leased anyway, or answered, fails it)."""
    import grpc

    from fleetrl.v1 import controller_pb2_grpc

    monkeypatch.setattr(servicer_module, "LEASE_RECHECK_S", 30.0)
    servicer, orch = make(tmp_path)
    handler_ended: list[str] = []
    lease_rows = servicer.LeaseRows

    async def recorded(request, context):
        try:
            reply = await lease_rows(request, context)
        except asyncio.CancelledError:
            handler_ended.append("cancelled")
            raise
        handler_ended.append(f"answered with {len(reply.rows)} rows")
        return reply

    servicer.LeaseRows = recorded  # what the server calls (bound when it is registered below)
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = controller_pb2_grpc.ControllerStub(channel).LeaseRows(request(wait_s=5.0))
            await async_wait_until(lambda: orch.lease_signal.waiting == 1, 10.0, "the call held on the controller")
            call.cancel()
            await async_wait_until(lambda: handler_ended, 10.0, "the held handler to end")
        assert handler_ended == ["cancelled"]
        assert orch.lease_signal.waiting == 0  # nothing left waiting to lease when the gate opens
        orch.started = True
        orch.lease_signal.notify()
        await LeaseSignal.yield_to_waiters()
        assert servicer.scheduler.leased_to("gw") == 0
        assert len(servicer.scheduler.lease("other", 4, NOW)) == 4  # the rows are there for a gateway that asks
    finally:
        await server.stop(None)
