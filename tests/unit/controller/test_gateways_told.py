"""The controller's exit waits only until every live gateway has been told the run finished
(`Orchestrator.wait_gateways_told`), never longer than its timeout, so no gateway is left retrying a controller
that is gone and no exit waits a second for nothing."""

from __future__ import annotations

import asyncio
import time

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2
from tests.waiting import async_wait_until


def make(tmp_path, gateways: list[str]) -> tuple[ControllerServicer, Orchestrator]:
    now = time.time()
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    for gateway in gateways:
        members.register("gateway", gateway, "", now)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl")
    servicer = ControllerServicer(scheduler, members, orch, run_id="r", heartbeat_interval_s=2.0)
    return servicer, orch


class Context:
    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


async def test_the_wait_ends_once_every_live_gateway_was_told(tmp_path, monkeypatch):
    servicer, orch = make(tmp_path, ["a", "b"])
    checks = []  # the gateways told, each time the live gateways were looked up (what the wait compares)
    alive = orch.members.alive

    def counted_alive(kind, now):
        if kind == "gateway":
            checks.append(set(orch.told_finished))
        return alive(kind, now)

    monkeypatch.setattr(orch.members, "alive", counted_alive)
    orch.finished = True
    waiting = asyncio.create_task(orch.wait_gateways_told(timeout_s=30.0))
    await servicer.LeaseRows(controller_pb2.LeaseRowsRequest(gateway_id="a", max_rows=1), Context())
    await async_wait_until(lambda: {"a"} in checks, 5.0, "the wait to look again once a was told")
    assert not waiting.done()  # it saw b had not heard yet, and waits on
    await servicer.Heartbeat(controller_pb2.HeartbeatRequest(member_id="b"), Context())
    await asyncio.wait_for(waiting, 5.0)
    assert orch.told_finished == {"a", "b"}


async def test_a_reply_before_the_run_finished_tells_nobody(tmp_path):
    servicer, orch = make(tmp_path, ["a"])
    await servicer.LeaseRows(controller_pb2.LeaseRowsRequest(gateway_id="a", max_rows=1), Context())
    assert orch.told_finished == set()


async def test_the_wait_gives_up_at_its_timeout(tmp_path):
    _, orch = make(tmp_path, ["silent"])
    orch.finished = True
    started = time.monotonic()
    await asyncio.wait_for(orch.wait_gateways_told(timeout_s=0.2), 5.0)
    assert time.monotonic() - started >= 0.2 and orch.told_finished == set()


async def test_no_live_gateway_means_no_wait(tmp_path):
    _, orch = make(tmp_path, [])
    orch.finished = True
    await asyncio.wait_for(orch.wait_gateways_told(timeout_s=30.0), 1.0)


async def test_a_gateway_registering_after_the_finish_is_told_in_the_register_reply(tmp_path):
    """A gateway slow to start registered 140 ms after the run finished (a compose run): the controller's wait
    had already passed, it exited, and the gateway was left retrying a controller that was gone. The register
    reply now says the run finished, and counts as telling it."""
    servicer, orch = make(tmp_path, [])
    orch.finished = orch.completed = True
    reply = await servicer.Register(
        controller_pb2.RegisterRequest(kind=controller_pb2.GATEWAY, member_id="late"), Context()
    )
    assert reply.run_finished and not reply.run_stopped
    assert orch.told_finished == {"late"}
    await asyncio.wait_for(orch.wait_gateways_told(timeout_s=30.0), 1.0)


async def test_a_register_reply_says_whether_the_run_stopped_or_goes_on(tmp_path):
    servicer, orch = make(tmp_path, [])
    request = controller_pb2.RegisterRequest(kind=controller_pb2.GATEWAY, member_id="g")
    reply = await servicer.Register(request, Context())
    assert not reply.run_finished and not reply.run_stopped and orch.told_finished == set()
    orch.finished = True  # ended without finishing (a signal, a failure)
    reply = await servicer.Register(request, Context())
    assert reply.run_stopped and not reply.run_finished
