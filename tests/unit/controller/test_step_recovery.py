"""Every trained step appears exactly once in metrics.jsonl and samples.jsonl across a controller killed at any
point (issue 45, item 3). A controller killed while the trainer trained a step never heard back about it: the
resumed controller asks the trainer for the result of each recent step its record lacks and writes what is missing,
once, even when it is killed again halfway through. Before, the step was counted as trained and never recorded."""

from __future__ import annotations

import json

import grpc

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.controller.step_recovery import (
    RECOVERED,
    cut_torn_tail,
    recovered_line,
    steps_in_samples,
    steps_to_recover,
)
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc


def test_the_steps_to_recover_are_the_recent_ones_missing_a_line_or_their_due_samples():
    assert steps_to_recover(5, [1, 2, 3, 4], [1, 2, 3, 4], samples_interval=1) == [5]
    assert steps_to_recover(5, [1, 2, 3, 4, 5], [1, 2, 3, 4], samples_interval=1) == [5]  # killed between the two
    assert steps_to_recover(5, [1, 2, 3, 4, 5], [2, 4], samples_interval=2) == []  # step 5 logs no samples
    assert steps_to_recover(5, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5], samples_interval=1) == []
    assert steps_to_recover(0, [], [], samples_interval=1) == []
    assert steps_to_recover(9, [], [], samples_interval=0, window=3) == [7, 8, 9]


def test_a_recovered_line_has_the_trainers_figures_and_says_it_was_recovered():
    line = recovered_line(
        {"train/loss": 0.5, "async/version_offset_max": 1.0},
        step=3,
        version=3,
        time=1.0,
        done_frac=0.5,
        counters={"rows_leased": 6},
    )
    assert line["step"] == 3 and line["train/loss"] == 0.5 and line["async/version_offset_max"] == 1.0
    assert line[RECOVERED] == 1 and line["producer/rows_leased"] == 6 and line["progress/done_frac"] == 0.5
    assert not [k for k in line if k.startswith("perf/")]


def test_a_sample_line_cut_short_counts_for_no_step(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "ro')
    assert steps_in_samples(path) == {1} and steps_in_samples(tmp_path / "none.jsonl") == set()


class ResumedTrainer(trainer_pb2_grpc.TrainerServicer):
    """A trainer resumed at version 5 that kept its last steps' results: a TrainStep for one of them answers with
    it again (fleetrl.trainer.step_records); for an older one it has no record (empty metrics)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def TrainStep(self, request, context):
        self.asked.append(request.step)
        if request.step < 3:
            return trainer_pb2.TrainStepResponse(step=request.step, version=request.step, already_trained=True)
        return trainer_pb2.TrainStepResponse(
            step=request.step,
            version=request.step,
            already_trained=True,
            metrics={"train/loss": 0.1 * request.step, "async/version_offset_max": 1.0},
            samples=[trainer_pb2.TrainSample(row_id=10 + request.step, prompt="p", completion="c", reward=1.0)],
        )


def write_record(log_path, steps):
    (log_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "version": s}) + "\n" for s in steps))
    (log_path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "row_id": s}) + "\n" for s in steps))


async def test_a_resumed_controller_writes_the_step_it_never_heard_back_about_exactly_once(tmp_path):
    trainer = ResumedTrainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    write_record(tmp_path, [1, 2, 3, 4])  # the journal and the record end at step 4; the trainer trained 5

    async def resume():
        scheduler = RowScheduler(
            DatasetCursor([{"q": i} for i in range(40)], shuffle=False),
            OffPolicyGate(2, 2, 1),
            prompt_groups_per_step=2,
        )
        members = MemberRegistry(heartbeat_timeout_s=30)
        members.register("trainer", "trainer", f"127.0.0.1:{port}", 0.0)
        config = ControllerConfig(run=Config(log_path=str(tmp_path), log_samples_interval=1), rows_path="rows.jsonl")
        orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "metrics.jsonl", clock=lambda: 0.0)
        try:
            return await orch.recover_record(5)
        finally:
            orch.close_trackers(failed=False)
            await orch.close()

    try:
        assert await resume() == [5]
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]  # before: step 5 never had a line
        assert lines[-1]["train/loss"] == 0.5 and lines[-1][RECOVERED] == 1
        samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
        assert [(s["step"], s["row_id"]) for s in samples][-2:] == [(4, 4), (5, 15)]

        # Killed again after the line, before the samples: the next resume writes the samples alone.
        (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples[:-1]))
        assert await resume() == [5]
        assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
        assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()][-2:] == [4, 5]

        # Resumed once more: nothing is missing, nothing is asked or written twice.
        trainer.asked.clear()
        assert await resume() == [] and trainer.asked == []
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
        assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 5
    finally:
        await server.stop(None)


async def test_a_step_the_trainer_kept_no_record_of_is_warned_about_not_invented(tmp_path, caplog):
    trainer = ResumedTrainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    write_record(tmp_path, [1])
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(40)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("trainer", "trainer", f"127.0.0.1:{port}", 0.0)
    config = ControllerConfig(run=Config(log_path=str(tmp_path), log_samples_interval=1), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "metrics.jsonl", clock=lambda: 0.0)
    try:
        assert await orch.recover_record(3) == [3]  # step 2: no record on the trainer; step 3: recovered
        assert trainer.asked == [2, 3]
        assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]
        assert "step 2 has no line in metrics.jsonl and the trainer kept no record of it" in caplog.text
    finally:
        orch.close_trackers(failed=False)
        await orch.close()
        await server.stop(None)


async def test_a_metrics_line_cut_short_by_the_kill_is_replaced_not_fatal(tmp_path, caplog):
    # Before: the resume failed reading metrics.jsonl ("metrics.jsonl:3: not valid JSON") after every service started.
    trainer = ResumedTrainer()
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(trainer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    write_record(tmp_path, [1, 2, 3])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text().rsplit("\n", 2)[0] + '\n{"step": 3, "train/lo')  # a torn write of 3
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(40)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    scheduler.resumed = True
    members = MemberRegistry(heartbeat_timeout_s=30)
    members.register("trainer", "trainer", f"127.0.0.1:{port}", 0.0)
    config = ControllerConfig(run=Config(log_path=str(tmp_path), log_samples_interval=1), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path=metrics, clock=lambda: 0.0)
    try:
        orch.cut_record(3)
        assert await orch.recover_record(3) == [3]
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2, 3] and lines[-1][RECOVERED] == 1
        assert "ended in a line cut short" in caplog.text
    finally:
        orch.close_trackers(failed=False)
        await orch.close()
        await server.stop(None)


def test_only_a_last_line_without_its_newline_is_torn(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')  # whole, its newline missing: kept
    assert cut_torn_tail(path) is None and path.read_text() == '{"step": 1}\n{"step": 2}'
    path.write_text('{"step": 1}\nnot json\n')  # damage, not a torn write: left for the reader to name
    assert cut_torn_tail(path) is None
    path.write_text('{"step": 1}\n{"st')
    assert cut_torn_tail(path) == '{"st' and path.read_text() == '{"step": 1}\n'
