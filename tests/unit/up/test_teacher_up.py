"""`fleetrl up` with a distillation teacher (issue 32 part 2): the reference (colocated copy or service) is started
even with kl_beta = 0, a reference service serves the teacher and checks its tokenizer against the run's at start,
and `fleetrl up` refuses a teacher with another tokenizer (or no model at its path) before any process starts,
naming both models. The command lines are recorded; no process starts."""

from __future__ import annotations

import json

import pytest

from fleetrl.config import Config
from fleetrl.services.reference.config import ReferenceConfig
from fleetrl.tiny_model import build_tiny_model
from fleetrl.up import run as up_run
from tests.unit.up.test_reference_placement import _sixteen_cpus, flag, started_stack, up_config

__all__ = ["_sixteen_cpus"]  # the autouse fixture, for this module too


def test_a_teacher_without_kl_gets_the_colocated_reference(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.0, teacher_model="t")
    services = started_stack(tmp_path, monkeypatch, run, up_config(tmp_path))
    assert set(services) == {"inference-0", "trainer", "controller"}
    assert flag(services["trainer"]["argv"], "--reference") == "local"  # the trainer loads the teacher itself
    plain = Config(base_model="m", kl_beta=0.0)
    assert (
        "--reference"
        not in started_stack(tmp_path / "plain", monkeypatch, plain, up_config(tmp_path))["trainer"]["argv"]
    )


def test_a_reference_service_serves_the_teacher_and_checks_the_students_tokenizer(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.0, teacher_model="t", tokenizer_model="tok")
    services = started_stack(tmp_path, monkeypatch, run, up_config(tmp_path, reference_placement="service"))
    ref = services["reference"]["argv"]
    assert flag(ref, "--model") == "t" and flag(ref, "--student-model") == "tok"
    assert flag(services["inference-0"]["argv"], "--model") == "m"  # the replicas serve the student
    without = Config(base_model="m", kl_beta=0.01)
    ref = started_stack(tmp_path / "kl", monkeypatch, without, up_config(tmp_path, reference_placement="service"))
    assert flag(ref["reference"]["argv"], "--model") == "m" and "--student-model" not in ref["reference"]["argv"]


def _run_file(tmp_path, **run: object) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {"log_path": str(tmp_path / "log"), **run}, "up": {"rollout": "m:f"}}))
    return str(path)


def test_fleetrl_up_refuses_a_teacher_with_another_tokenizer_naming_both(tiny_model_dir, tmp_path, capsys):
    other = str(build_tiny_model(tmp_path / "other", vocab_size=300))
    assert up_run.main([_run_file(tmp_path, base_model=tiny_model_dir, teacher_model=other)]) == 2
    err = capsys.readouterr().err
    assert f"teacher_model: the tokenizer of {other} differs from the run's ({tiny_model_dir})" in err
    assert not (tmp_path / "log").exists()  # refused before anything started


def test_fleetrl_up_refuses_a_teacher_path_that_does_not_exist(tiny_model_dir, tmp_path, capsys):
    missing = str(tmp_path / "no_teacher")
    assert up_run.main([_run_file(tmp_path, base_model=tiny_model_dir, teacher_model=missing)]) == 2
    assert "run.teacher_model: no model at" in capsys.readouterr().err


def test_the_reference_service_refuses_a_teacher_with_another_tokenizer(tiny_model_dir, tmp_path):
    from fleetrl.services.reference.server import create_server

    other = str(build_tiny_model(tmp_path / "other", vocab_size=300))
    config = ReferenceConfig(model=other, student_model=tiny_model_dir, grpc_port=0, metrics_port=None)
    with pytest.raises(ValueError, match=r"^teacher_model: the tokenizer of .*other differs from the run's"):
        create_server(config)
