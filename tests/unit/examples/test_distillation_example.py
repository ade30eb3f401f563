"""examples/distillation/run.toml is a valid `fleetrl up` config: the arithmetic job's warm start as the student, its
RL-trained export as the teacher, pure distillation without a KL penalty, the arithmetic rollout and evaluation."""

from __future__ import annotations

from fleetrl import Config
from fleetrl.config import reference_model_path, wants_reference_logprobs
from fleetrl.up.config import UpConfig
from tests.unit.examples.helpers import EXAMPLES


def test_the_distillation_example_config_loads() -> None:
    path = EXAMPLES / "distillation" / "run.toml"
    run, up = Config.from_toml(path), UpConfig.from_file(path)
    assert (run.base_model, run.teacher_model) == ("runs/arithmetic/init/model", "runs/arithmetic/final")
    assert run.distill_weight == 1.0 and run.kl_beta == 0.0
    assert wants_reference_logprobs(run) and reference_model_path(run) == "runs/arithmetic/final"
    for spec in (up.rollout, up.evaluation):
        module, _, _ = str(spec).rpartition(":")
        assert (path.parent / module).is_file()
    arithmetic = Config.from_toml(EXAMPLES / "arithmetic" / "run.toml")
    assert run.dataset == arithmetic.dataset and run.eval_dataset == arithmetic.eval_dataset
