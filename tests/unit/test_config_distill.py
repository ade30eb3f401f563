"""The distillation fields of the run config (issue 32 part 2): `teacher_model` and `distill_weight`, checked at
start with errors that name the field, and what they imply for the reference (fleetrl.config)."""

from __future__ import annotations

import pytest

from fleetrl.config import Config, ConfigError, reference_model_path, wants_reference_logprobs


def load(**values: object) -> Config:
    return Config.load({"base_model": "m", **values})


def test_a_teacher_defaults_to_pure_distillation_and_needs_the_reference_even_without_kl() -> None:
    cfg = load(teacher_model="runs/teacher", kl_beta=0.0)
    assert cfg.distill_weight == 1.0
    assert wants_reference_logprobs(cfg)
    assert reference_model_path(cfg) == "runs/teacher"
    mixed = load(teacher_model="runs/teacher", distill_weight=0.25)
    assert mixed.distill_weight == 0.25


def test_without_a_teacher_nothing_changes() -> None:
    cfg = load(kl_beta=0.0)
    assert cfg.teacher_model is None and cfg.distill_weight == 0.0
    assert not wants_reference_logprobs(cfg)
    assert reference_model_path(cfg) == "m"
    assert wants_reference_logprobs(load(kl_beta=0.01))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"teacher_model": "t", "distill_weight": 1.5}, r"distill_weight: .*less than or equal to 1"),
        ({"teacher_model": "t", "distill_weight": -0.1}, r"distill_weight: .*greater than or equal to 0"),
        ({"distill_weight": 0.5}, r"distill_weight \(0.5\) needs teacher_model"),
        ({"teacher_model": ""}, r"teacher_model: .*path"),
        ({"teacher_model": "t", "lora_rank": 8}, r"teacher_model: .*LoRA"),
    ],
)
def test_a_bad_distillation_setting_is_refused_naming_the_field(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(**values)


def test_a_plain_namespace_without_the_fields_reads_as_no_teacher() -> None:
    class Bare:
        kl_beta = 0.0
        base_model = "m"

    assert not wants_reference_logprobs(Bare())
    assert reference_model_path(Bare()) == "m"
