"""A group that never reaches the trainer is a lost group, not a dead run (issue 28, item 6): the trainer answers
the step with "groups of rows [...] did not arrive" (FAILED_PRECONDITION); the controller supersedes those attempts,
leases the rows again (first), counts `groups_lost`, warns, and forms the step again. Before, any TrainStep error
failed the run (the probe's runs died at steps 4, 18 and 25).
"""

from __future__ import annotations

import grpc

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.trainer.buffer import MissingGroupsError
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc


def make(max_attempts: int = 3) -> RowScheduler:
    cursor = DatasetCursor([{"q": i} for i in range(8)], shuffle=False)
    return RowScheduler(cursor, OffPolicyGate(2, 2, 1), prompt_groups_per_step=2, max_attempts=max_attempts)


def one_step(s: RowScheduler):
    leases = s.lease("gw", 2, now=0)
    for lease in leases:
        assert s.report(lease.row_id, "accepted", now=1, min_version=0, attempt=lease.attempt) == "accepted"
    return s.take_step()


def test_a_lost_group_is_superseded_and_its_row_leased_again_first():
    s = make()
    step = one_step(s)
    assert step.step == 1 and step.row_ids == (0, 1)
    assert s.groups_lost(step, {0}) == [0]
    assert s.counters["groups_lost"] == 1 and s.take_superseded() == [(0, 1)]
    assert s.take_step() is None  # row 1's group waits for the step to be formed again
    (again,) = s.lease("gw", 1, now=2)
    assert (again.row_id, again.attempt) == (0, 2)  # first, as a new attempt
    s.report(0, "accepted", now=3, min_version=0, attempt=2)
    step = s.take_step()
    assert step.step == 1 and step.row_ids == (1, 0) and step.attempts == (1, 2)


def test_a_row_whose_group_keeps_getting_lost_is_closed_after_max_attempts():
    s = make(max_attempts=1)
    step = one_step(s)
    assert s.groups_lost(step, {0, 1}) == []
    assert s.counters["rows_failed"] == 2 and not s.queue


class Trainer(trainer_pb2_grpc.TrainerServicer):
    """Loses row 0's group on the first TrainStep, as a trainer whose socket dropped an oversized frame does."""

    def __init__(self) -> None:
        self.steps: list[trainer_pb2.TrainStepRequest] = []

    async def TrainStep(self, request, context):
        self.steps.append(request)
        if len(self.steps) == 1:
            missing = MissingGroupsError([(0, 1)], 30.0)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"TrainStep {request.step}: {missing}")
        return trainer_pb2.TrainStepResponse(version=request.step, published=False)


async def test_the_controller_requeues_a_lost_group_instead_of_failing_the_run(tmp_path):
    trainer = Trainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    scheduler = make()
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("trainer", "trainer", f"127.0.0.1:{port}", 0.0)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=lambda: 0.0)
    try:
        await orch.train_and_publish(one_step(scheduler))  # before: RunFailed("trainer failed step 1: ...")
        assert scheduler.counters["groups_lost"] == 1 and scheduler.trained_steps == 0
        (again,) = scheduler.lease("gw", 1, now=1)
        assert (again.row_id, again.attempt) == (0, 2)
        scheduler.report(0, "accepted", now=2, min_version=0, attempt=2)
        await orch.train_and_publish(scheduler.take_step())
        assert scheduler.trained_steps == 1
        retried = trainer.steps[1]
        assert [(g.row_id, g.attempt) for g in retried.groups] == [(1, 1), (0, 2)]
        assert [(g.row_id, g.attempt) for g in retried.superseded] == [(0, 1)]  # the trainer evicts the lost one
    finally:
        await orch.close()
        await server.stop(None)


def test_the_cut_short_list_counts_every_row_of_the_step_as_lost():
    from fleetrl.services.controller.orchestrator import lost_groups

    class Error(grpc.aio.AioRpcError):
        def __init__(self, details):
            self._details = details

        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return self._details

    s = make()
    step = one_step(s)
    missing = MissingGroupsError([(r, 1) for r in range(25)], 30.0)
    assert lost_groups(Error(f"TrainStep 1: {missing}"), step) == {0, 1}
    assert lost_groups(Error(f"TrainStep 1: {MissingGroupsError([(1, 1)], 30.0)}"), step) == {1}
    assert lost_groups(Error("TrainStep 1: out of order"), step) is None
