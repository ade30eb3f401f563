"""A trainer's checkpoint keeps its last steps' results (issue 45, item 3): a resumed trainer answers a TrainStep
for a step it trained before the restart with that step's figures and logged samples, so a controller that was
killed before it heard back can still write the step's line. Before, the answer was empty."""

from __future__ import annotations

import math

from fleetrl.sample_log import LoggedSample
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.policy_trainer import StepResult
from fleetrl.trainer.step_records import RECORDS_KEPT, keep_recent, result_fields, step_record
from tests.unit.trainer.helpers import make_cfg, tiny_groups


def test_a_resumed_trainer_answers_a_step_it_trained_before_the_restart_with_its_result(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, log_samples_interval=1, log_samples_count=2)
    trainer = PolicyTrainer(cfg)
    groups = tiny_groups(tiny_model_dir, num_groups=4, group_size=4)
    trainer.train_step(groups[:2])
    trained = trainer.train_step(groups[2:])
    trainer.save_checkpoint()

    resumed = PolicyTrainer(cfg)
    assert resumed.resume() is True
    again = resumed.train_step([], step=2)  # what the trainer service answers a TrainStep for a step it did
    assert again.already_trained and again.version == 2
    assert again.metrics == trained.metrics  # before: {} (the result was lost with the process)
    assert again.samples == trained.samples and len(again.samples) == 2
    assert resumed.train_step([], step=1).samples[0].step == 1
    assert resumed.steps_done == 2  # answering changed nothing


def test_records_keep_the_newest_steps_and_read_back_what_was_written():
    sample = LoggedSample(3, 7, "p", "c", 1.0, 1, "stop")
    result = StepResult(3, 3, {"train/loss": 0.5, "optim/grad_norm": math.inf}, [7], [8], samples=[sample])
    record = step_record(result)
    fields = result_fields(record)
    assert fields["metrics"]["train/loss"] == 0.5 and math.isnan(fields["metrics"]["optim/grad_norm"])
    assert fields["samples"] == [sample] and fields["row_ids"] == [7] and fields["skipped_row_ids"] == [8]
    records: list[dict] = []
    for step in range(1, 8):
        records = keep_recent(records, {**record, "step": step})
    assert [r["step"] for r in records] == list(range(8 - RECORDS_KEPT, 8))
    assert [r["step"] for r in keep_recent(records, {**record, "step": 7, "version": 9})][-1:] == [7]


def test_an_unreadable_record_costs_its_step_not_the_resume():
    assert result_fields({"step": 2}) is None
    assert result_fields("garbage") is None
    assert result_fields({"step": 2, "version": 2, "metrics": {}, "samples": [{"step": "x"}]}) is None
