"""The controller's per-step line: what the trainer reported plus the controller's figures (raw vs filtered reward
and the filter ratio from the groups the gateways rejected, progress, throughput, tracker failures), written to
metrics.jsonl and every tracker, with the step's decoded samples in samples.jsonl. Called directly, no sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler, StepAssignment
from fleetrl.controller.step_line import StepTimes
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.trackers import TrackerSet
from fleetrl.trackers.base import Tracker
from fleetrl.trackers.jsonl import JsonlTracker
from fleetrl.v1 import controller_pb2, trainer_pb2


class Context:
    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


class _Down(Tracker):
    name = "wandb"

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        raise ConnectionError("W&B is unreachable")

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        raise ConnectionError("W&B is unreachable")


def make(tmp_path) -> tuple[RowScheduler, Orchestrator]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 4, 1), prompt_groups_per_step=2
    )
    run = Config(log_path=str(tmp_path), completions_per_prompt=4, prompt_groups_per_step=2)
    metrics_path = tmp_path / "metrics.jsonl"
    trackers = TrackerSet([JsonlTracker(tmp_path, metrics_path), _Down()])
    config = ControllerConfig(run=run, rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, MemberRegistry(30), metrics_path=metrics_path, trackers=trackers)
    return scheduler, orch


def test_a_step_line_has_raw_and_filtered_reward_progress_and_samples(tmp_path):
    scheduler, orch = make(tmp_path)
    servicer = ControllerServicer(scheduler, orch.members, orch, run_id="r", heartbeat_interval_s=2.0)
    (lease,) = scheduler.lease("gw", 1, 0.0)
    rejected = controller_pb2.RowReport(
        row_id=lease.row_id,
        outcome=controller_pb2.REJECTED,
        reason="dynamic filter",
        attempt=lease.attempt,
        rewards=[1.0, 1.0, 1.0, 1.0],
    )
    asyncio.run(servicer.ReportRows(controller_pb2.ReportRowsRequest(gateway_id="gw", reports=[rejected]), Context()))
    reply = trainer_pb2.TrainStepResponse(
        step=1,
        version=1,
        metrics={"rollout/filtered_reward": 0.5, "data/samples": 8.0, "data/groups": 2.0, "train/loss": 0.1},
        samples=[
            trainer_pb2.TrainSample(
                row_id=1, prompt="q:", completion=" a", reward=1.0, version_offset=0, finish_reason="stop"
            )
        ],
    )
    step = StepAssignment(step=1, rows=((1, 0), (2, 0)), version_offsets=(0, 0))
    orch.write_metrics(step, reply, StepTimes(wait=1.0, train=0.5, weight_update=0.25, total=1.0))

    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout/filtered_reward"] == 0.5 and line["train/loss"] == 0.1
    assert line["rollout/raw_reward"] == pytest.approx((0.5 * 8 + 4 * 1.0) / 12)  # the refused group counts
    assert line["rollout/filter_ratio"] == pytest.approx(1 / 3) and line["rollout/groups_filtered"] == 1
    assert line["progress/done_frac"] == 0.25  # step 1 of the 4 the 8 rows fill
    assert line["perf/samples_per_s"] == 4.0 and line["perf/step_time"] == 2.0
    assert line["trackers/failures"] == 0  # the failure of this very line is counted from the next one
    (sample,) = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sample == {
        "step": 1,
        "row_id": 1,
        "prompt": "q:",
        "completion": " a",
        "reward": 1.0,
        "version_offset": 0,
        "finish_reason": "stop",
    }
    assert orch.trackers.flush(timeout_s=30)
    assert orch.trackers.failures == {"jsonl": 0, "wandb": 2}  # its line and its samples; the run went on

    orch.write_metrics(
        StepAssignment(2, ((3, 1), (4, 1)), (0, 0)),
        trainer_pb2.TrainStepResponse(
            step=2, version=2, metrics={"rollout/filtered_reward": 0.25, "data/samples": 8.0, "data/groups": 2.0}
        ),
        StepTimes(wait=0.0, train=0.5, weight_update=0.0, total=0.5),
    )
    second = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert second["rollout/raw_reward"] == 0.25 and second["rollout/filter_ratio"] == 0.0  # counted once
    assert second["trackers/failures"] == 2
