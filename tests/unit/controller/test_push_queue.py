"""Overlapped weight pushes (issue 39 item 1): with O >= 1 the controller sends the next TrainStep while the last
version is still travelling to the replicas; one push in flight, a newer version supersedes one waiting, the gate
opens only at versions the replicas serve. O = 0 stays strictly serial.

The queue's rules are pure (PushQueue); the orchestrator's use of them runs against real gRPC stand-ins: a trainer
that publishes every step and a replica whose LoadWeights waits for the test to release it (a replica that loads
slowly, with no sleeps and no clocks)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.push_queue import PushJob, PushQueue
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunFailed
from fleetrl.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from tests.waiting import async_wait_until


def job(version: int, at: float = 0.0) -> PushJob:
    return PushJob(version, "tcp://trainer:5555", 100, at)


def test_one_push_in_flight_and_a_newer_version_supersedes_the_waiting_one():
    q = PushQueue()
    assert q.published(job(1, at=10.0)) == job(1, at=10.0)  # nothing in flight: starts now
    assert q.published(job(2)) is None and q.pending == job(2)  # waits
    assert q.published(job(3)) is None and q.pending == job(3) and q.superseded == 1  # 2 is never pushed
    assert q.done(1, now=12.5) == job(3)  # the newest goes next
    assert q.take_served() == [(1, 2.5)] and q.take_served() == []
    assert q.done(3, now=13.0) is None and q.idle()
    with pytest.raises(ValueError, match="published after"):
        q.published(job(3))  # versions only move forward
    q.published(job(4))
    with pytest.raises(ValueError, match="push of version 5 ended"):
        q.done(5, now=1.0)
    q.failed()
    assert q.idle()


class Trainer(trainer_pb2_grpc.TrainerServicer):
    """Publishes a version at every step (version = step), recording the order of events."""

    def __init__(self, events: list) -> None:
        self.events = events

    async def TrainStep(self, request, context):
        self.events.append(("train", request.step))
        return trainer_pb2.TrainStepResponse(
            version=request.step, published=True, weights_address="tcp://trainer:5555", weights_bytes=1000
        )


class SlowReplica(inference_pb2_grpc.InferenceServicer):
    """Each LoadWeights waits until the test releases its version (or fails it)."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.release: dict[int, asyncio.Event] = {}
        self.refuse: set[int] = set()
        self.loaded = 0

    def gate(self, version: int) -> asyncio.Event:
        return self.release.setdefault(version, asyncio.Event())

    async def Status(self, request, context):
        return inference_pb2.StatusResponse(loaded_version=self.loaded)

    async def LoadWeights(self, request, context):
        self.events.append(("load", request.version))
        await self.gate(request.version).wait()
        if request.version in self.refuse:
            await context.abort(grpc.StatusCode.INTERNAL, f"version {request.version}: checksum mismatch")
        self.loaded = request.version
        self.events.append(("served", request.version))
        return inference_pb2.LoadWeightsResponse(version=request.version)


@pytest.fixture
async def stack(tmp_path):
    events: list = []
    trainer, replica = Trainer(events), SlowReplica(events)
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    inference_pb2_grpc.add_InferenceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    made = []

    def make(max_offpolicy: int, overlap: bool = True) -> Orchestrator:
        members = MemberRegistry(heartbeat_timeout_s=30)
        members.register("trainer", "trainer", f"127.0.0.1:{port}", now=0)
        members.register("inference", "inference-0", f"127.0.0.1:{port}", now=0)
        scheduler = RowScheduler(
            DatasetCursor([{"q": i} for i in range(16)], shuffle=False),
            OffPolicyGate(1, 1, max_offpolicy),
            prompt_groups_per_step=1,
        )
        run = Config(max_head_offpolicy_versions=max_offpolicy, overlap_weight_push=overlap)
        config = ControllerConfig(run=run, rows_path="rows.jsonl", weight_push_timeout_s=60.0)
        orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: 0.0)
        made.append(orch)
        return orch

    yield make, replica, events
    for orch in made:
        if orch._push_task is not None:
            orch._push_task.cancel()
        await orch.close()
    await server.stop(None)


def ready_step(orch: Orchestrator, sampled_at: int):
    """One row leased and reported back with tokens of version `sampled_at`: the step it completes."""
    (lease,) = orch.scheduler.lease("gw", 1, now=0)
    outcome = orch.scheduler.report(lease.row_id, "accepted", now=0, min_version=sampled_at, attempt=lease.attempt)
    assert outcome == "accepted", outcome
    return orch.scheduler.take_step()


async def test_with_o_1_the_next_step_trains_while_the_version_travels(stack, tmp_path):
    make, replica, events = stack
    orch = make(max_offpolicy=1)
    await orch.train_and_publish(ready_step(orch, 0))  # returns with version 1 still loading
    await async_wait_until(lambda: ("load", 1) in events, 10, "the push of version 1")
    assert orch.scheduler.gate.version == 0  # the gate opens only at versions the replicas serve
    await orch.train_and_publish(ready_step(orch, 0))  # step 2 trains from version 0's samples: offset 1
    assert events.index(("train", 2)) < len(events) and ("served", 1) not in events  # trained while 1 travelled
    assert orch.pushes.in_flight.version == 1 and orch.pushes.pending.version == 2
    replica.gate(1).set()
    await async_wait_until(lambda: ("load", 2) in events, 10, "version 2 pushed once 1 is served")
    assert orch.scheduler.gate.version == 1
    replica.gate(2).set()
    assert await orch.drain_pushes() >= 0
    assert orch.scheduler.gate.version == 2 and orch.pushes.idle()
    assert events == [("train", 1), ("load", 1), ("train", 2), ("served", 1), ("load", 2), ("served", 2)]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["perf/push_wait_time"] for line in lines] == [0.0, 0.0]  # the trainer never waited for a push
    assert all(line["perf/weight_update_time"] == 0.0 for line in lines)


async def test_a_version_published_while_one_waits_supersedes_it(stack, tmp_path):
    make, replica, events = stack
    orch = make(max_offpolicy=2)
    await orch.train_and_publish(ready_step(orch, 0))
    await async_wait_until(lambda: ("load", 1) in events, 10, "the push of version 1")
    await orch.train_and_publish(ready_step(orch, 0))  # offset 1
    await orch.train_and_publish(ready_step(orch, 0))  # offset 2: version 3 supersedes the waiting 2
    assert orch.pushes.superseded == 1
    replica.gate(1).set()
    replica.gate(3).set()
    await orch.drain_pushes()
    assert [e for e in events if e[0] == "load"] == [("load", 1), ("load", 3)]  # 2 never pushed
    assert orch.scheduler.gate.version == 3  # the gate jumps with the replicas
    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert last["async/versions_superseded"] == 1


async def test_a_sample_past_the_bound_is_requeued_while_pushes_lag(stack):
    """The bound is the step's, not the push's: with version 2 still travelling, a group with tokens of version 0
    would join step 3, which trains from version 2 (offset 2 > O = 1): it is requeued, whatever the replicas serve.
    And while the replicas lag, the gate admits no row past O versions of what they serve."""
    make, replica, _events = stack
    orch = make(max_offpolicy=1)
    await orch.train_and_publish(ready_step(orch, 0))
    await orch.train_and_publish(ready_step(orch, 0))  # step 2 at offset 1
    assert orch.scheduler.lease("gw", 1, now=0) == []  # replicas serve 0: no room past version 0 + O
    replica.gate(1).set()
    await async_wait_until(lambda: orch.scheduler.gate.version == 1, 10, "version 1 served")
    (lease,) = orch.scheduler.lease("gw", 1, now=0)
    assert orch.scheduler.report(lease.row_id, "accepted", now=0, min_version=0, attempt=lease.attempt) == "stale"
    replica.gate(2).set()
    await orch.drain_pushes()


async def test_with_o_0_every_push_is_awaited_before_the_next_step(stack, tmp_path):
    make, replica, events = stack
    orch = make(max_offpolicy=0)
    step = asyncio.create_task(orch.train_and_publish(ready_step(orch, 0)))
    await async_wait_until(lambda: ("load", 1) in events, 10, "the push of version 1")
    assert not step.done()  # the step waits for the push: strictly serial
    replica.gate(1).set()
    await asyncio.wait_for(step, 10)
    assert orch.scheduler.gate.version == 1 and orch._push_task is None
    line = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert line["perf/push_wait_time"] == line["perf/weight_update_time"]  # the whole push, idle


async def test_overlap_can_be_turned_off(stack):
    make, replica, events = stack
    orch = make(max_offpolicy=1, overlap=False)
    step = asyncio.create_task(orch.train_and_publish(ready_step(orch, 0)))
    await async_wait_until(lambda: ("load", 1) in events, 10, "the push of version 1")
    assert not step.done()
    replica.gate(1).set()
    await asyncio.wait_for(step, 10)


async def test_a_push_that_fails_beside_training_fails_the_run_loudly(stack):
    make, replica, _events = stack
    orch = make(max_offpolicy=1)
    replica.refuse.add(1)
    await orch.train_and_publish(ready_step(orch, 0))
    replica.gate(1).set()
    with pytest.raises(RunFailed, match="every inference replica failed to load version 1"):
        await orch.drain_pushes()
    assert orch.scheduler.gate.version == 0 and orch.pushes.idle()
