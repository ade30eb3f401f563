"""A resume cuts samples.jsonl back with metrics.jsonl (issue 28, item 10): the samples logged by steps the killed
trainer lost are moved to samples.superseded.jsonl, so the retrained steps' samples are not logged twice."""

from __future__ import annotations

import json

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator


def test_a_resume_cuts_the_samples_of_later_steps(tmp_path):
    samples = tmp_path / "samples.jsonl"
    lines = [json.dumps({"step": step, "row_id": i, "completion": "x"}) for step in (1, 2, 3, 4) for i in range(2)]
    samples.write_text("\n".join(lines) + "\n" + '{"step": 4, "row')  # the last line cut short by the kill
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(4)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    scheduler.resumed = True
    config = ControllerConfig(run=Config(log_path=str(tmp_path)), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, MemberRegistry(), metrics_path=tmp_path / "metrics.jsonl")
    orch.cut_record(2)  # the trainer's checkpoint is at version 2
    kept = [json.loads(line)["step"] for line in samples.read_text().splitlines()]
    assert kept == [1, 1, 2, 2]  # before: every line stayed, and steps 3-4 were logged again when retrained
    moved = (tmp_path / "samples.superseded.jsonl").read_text().splitlines()
    assert len(moved) == 5
