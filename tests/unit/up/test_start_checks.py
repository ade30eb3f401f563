"""Every user input checked before anything starts (issue 45, item 7): the judge's and the teacher's model folders, a
custom loss, the environment a run names and the environment variables every service reads are refused by `fleetrl
up` with exit 2 and one line naming the field, before any service starts. Before, each passed the config check and
failed in the service that loads it (a judge replica, the trainer, every gateway, every service's logging)."""

from __future__ import annotations

import json
import shutil

import pytest

from fleetrl.up import run as up_run
from tests.unit.up.test_up_config_checks import write_config


def set_fields(config, run=None, up=None):
    data = json.loads(config.read_text())
    data["run"].update(run or {})
    data["up"].update(up or {})
    config.write_text(json.dumps(data))
    return config


def refused(config, capsys, monkeypatch, prefix):
    """`fleetrl up` exits 2 with one line starting `fleetrl up: <prefix>`, and starts nothing; returns that line."""
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    code = up_run.main([str(config)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err and err.startswith(f"fleetrl up: {prefix}"), err
    assert not (config.parent / "run").exists()  # refused before the run's folder was touched
    return err


def starts(config, capsys, monkeypatch):
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: 0)
    assert up_run.main([str(config)]) == 0, capsys.readouterr().err


def model_without_weights(tiny_model_dir, folder):
    """A folder with the tiny model's config and tokenizer but not its weights (a copy cut short)."""
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return str(folder)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d, tiny: (d.mkdir(), str(d))[1], "holds no model (no config.json)"),
        (lambda d, tiny: model_without_weights(tiny, d), "holds no weights"),
        (lambda d, tiny: (d.write_text("x"), str(d))[1], "is a file, not a model folder"),
        (lambda d, tiny: (d.mkdir(), (d / "config.json").write_text("{oops"), str(d))[2], "config.json:1: not valid"),
        (
            lambda d, tiny: (d.mkdir(), (d / "adapter_config.json").write_text("{}"), str(d))[2],
            "is a PEFT adapter (adapter_config.json), not a model",
        ),
    ],
)
def test_a_judge_folder_that_holds_no_model_is_refused_naming_the_field(
    tmp_path, tiny_model_dir, capsys, monkeypatch, make, message
):
    judge = make(tmp_path / "judge", tiny_model_dir)
    config = set_fields(write_config(tmp_path), up={"judge_model": judge})
    assert message in refused(config, capsys, monkeypatch, "up.judge_model: ")


def test_a_judge_that_is_a_model_starts(tmp_path, tiny_model_dir, capsys, monkeypatch):
    starts(set_fields(write_config(tmp_path), up={"judge_model": tiny_model_dir}), capsys, monkeypatch)


def test_a_hub_judge_missing_from_the_cache_is_refused_when_offline(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = set_fields(write_config(tmp_path), up={"judge_model": "fleetrl-tests/no-such-judge-45"})
    assert "not in the local Hugging Face cache" in refused(config, capsys, monkeypatch, "up.judge_model: ")


def test_a_teacher_folder_without_weights_is_refused_before_anything_starts(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    # Its tokenizer matches the run's, so the teacher's tokenizer check passed and the trainer failed to load it.
    teacher = model_without_weights(tiny_model_dir, tmp_path / "teacher")
    config = set_fields(write_config(tmp_path), run={"base_model": tiny_model_dir, "teacher_model": teacher})
    assert "holds no weights" in refused(config, capsys, monkeypatch, "run.teacher_model: ")


LOSSES = {
    "wrong_shape": (
        "import torch\n"
        "from fleetrl.losses import TokenLoss\n"
        "def loss(x, s):\n"
        "    return TokenLoss(x.logprobs.sum(dim=1))\n"
    ),
    "raises": "def loss(x, s):\n    raise RuntimeError('broken loss 45')\n",
    "good": (
        "from fleetrl.losses import TokenLoss\n"
        "def loss(x, s):\n"
        "    return TokenLoss(-x.advantages_B1 * x.tis_weights * x.logprobs)\n"
    ),
}


@pytest.mark.parametrize(
    ("spec", "module", "message"),
    [
        ("no_such_loss_module_45:loss", None, "cannot import module 'no_such_loss_module_45'"),
        ("losses_45.py:no_loss", "good", "has no attribute 'no_loss'"),
        ("losses_45.py:loss", "raises", "broken loss 45"),
        ("losses_45.py:loss", "wrong_shape", "trial call"),
    ],
)
def test_a_custom_loss_that_cannot_be_loaded_or_fails_its_trial_is_refused_at_start(
    tmp_path, capsys, monkeypatch, spec, module, message
):
    # Before: accepted by the config check (its syntax is an import path) and refused by the trainer once every
    # service had started.
    if module is not None:
        (tmp_path / "losses_45.py").write_text(LOSSES[module])
    monkeypatch.chdir(tmp_path)  # a file path is the trainer's: relative to fleetrl up's working directory
    config = set_fields(write_config(tmp_path), run={"policy_loss": spec})
    assert message in refused(config, capsys, monkeypatch, f"run.policy_loss {spec!r}")


def test_a_custom_loss_that_passes_its_trial_starts(tmp_path, capsys, monkeypatch):
    (tmp_path / "losses_ok_45.py").write_text(LOSSES["good"])
    starts(set_fields(write_config(tmp_path), run={"policy_loss": "losses_ok_45:loss"}), capsys, monkeypatch)


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"environment": "nowhere:thing"}, "expected one of verifiers:<id>, openenv:<id>"),
        ({"environment": "verifiers:no_such_taskset_45"}, "'no_such_taskset_45' is not importable"),
        ({"environment": ""}, "name the environment"),
    ],
)
def test_an_environment_that_cannot_be_loaded_is_refused_naming_the_field(
    tmp_path, capsys, monkeypatch, extras, message
):
    pytest.importorskip("fleetrl.environments")
    config = set_fields(write_config(tmp_path), run={"rollout_extras": extras})
    assert message in refused(config, capsys, monkeypatch, "run.rollout_extras.environment: ")


def test_environment_options_that_are_not_a_table_are_refused(tmp_path, capsys, monkeypatch):
    extras = {"environment": "verifiers:x", "environment_options": [1, 2]}
    config = set_fields(write_config(tmp_path), run={"rollout_extras": extras})
    refused(config, capsys, monkeypatch, "run.rollout_extras.environment_options: ")


@pytest.mark.parametrize(
    ("name", "value", "prefix"),
    [
        ("FLEETRL_LOG_LEVEL", "LOUD", "FLEETRL_LOG_LEVEL (environment) = 'LOUD': not a log level"),
        ("FLEETRL_AUTH_TOKEN", "t\u00f8ken", "FLEETRL_AUTH_TOKEN (environment): the token has"),
        ("FLEETRL_AUTH_TOKEN", "tok\nen", "FLEETRL_AUTH_TOKEN (environment): the token has"),
    ],
)
def test_an_environment_variable_every_service_would_refuse_is_refused_once_at_start(
    tmp_path, capsys, monkeypatch, name, value, prefix
):
    # Before: FLEETRL_LOG_LEVEL=LOUD passed fleetrl up and every service failed as it set up its logging.
    monkeypatch.setenv(name, value)
    refused(write_config(tmp_path), capsys, monkeypatch, prefix)


def test_a_configured_auth_token_is_named_as_the_field(tmp_path, capsys, monkeypatch):
    config = set_fields(write_config(tmp_path), up={"auth_token": "bad token\t45"})
    refused(config, capsys, monkeypatch, "up.auth_token: the token has")


def test_a_lower_case_log_level_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLEETRL_LOG_LEVEL", "debug")
    starts(write_config(tmp_path), capsys, monkeypatch)


def test_fleetrl_main_refuses_a_bad_custom_loss_or_teacher_before_anything_starts(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    from fleetrl import Config, main
    from fleetrl.up import embedded

    monkeypatch.setattr(embedded, "_launch", lambda *a, **k: pytest.fail("services were started"))
    bad_loss = Config(base_model=tiny_model_dir, log_path=str(tmp_path / "a"), policy_loss="no_such_loss_module_45:f")
    assert main(bad_loss, rollout_fn_factory=lambda setup: None, rows=[{"prompt": "a"}])["exit_code"] == 2
    assert capsys.readouterr().err.startswith("fleetrl.main: run.policy_loss 'no_such_loss_module_45:f'")
    teacher = model_without_weights(tiny_model_dir, tmp_path / "teacher")
    bad_teacher = Config(base_model=tiny_model_dir, log_path=str(tmp_path / "b"), teacher_model=teacher)
    assert main(bad_teacher, rollout_fn_factory=lambda setup: None, rows=[{"prompt": "a"}])["exit_code"] == 2
    assert capsys.readouterr().err.startswith("fleetrl.main: teacher_model: ")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("module", "shown"),
    [
        ("def make():\n    return None\n", "make()"),
        ("def make(setup, tokenizer):\n    return None\n", "make(setup, tokenizer)"),
        ("def make(*, setup):\n    return None\n", "make(*, setup)"),
    ],
)
def test_a_rollout_factory_that_cannot_take_the_setup_is_refused_at_start(tmp_path, capsys, monkeypatch, module, shown):
    # Before: imported and found callable, then every gateway failed calling it with the setup (a TypeError).
    (tmp_path / "factory_45.py").write_text(module)
    config = write_config(tmp_path, rollout="factory_45.py:make")
    err = refused(config, capsys, monkeypatch, "up.rollout: ")
    assert f"is {shown}: a rollout factory is called with one argument, the run's RolloutSetup" in err


@pytest.mark.parametrize(
    "module",
    [
        "def make(setup, extra=1):\n    return None\n",
        "def make(*args, **kwargs):\n    return None\n",
        "class make:\n    def __init__(self, setup):\n        pass\n",
    ],
)
def test_a_rollout_factory_that_takes_the_setup_starts(tmp_path, capsys, monkeypatch, module):
    (tmp_path / "factory_ok_45.py").write_text(module)
    starts(write_config(tmp_path, rollout="factory_ok_45.py:make"), capsys, monkeypatch)


def test_fleetrl_main_refuses_a_rollout_factory_without_the_setup(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from fleetrl import Config, main
    from fleetrl.up import embedded

    monkeypatch.setattr(embedded, "_launch", lambda *a, **k: pytest.fail("services were started"))
    cfg = Config(base_model=tiny_model_dir, log_path=str(tmp_path / "a"))
    assert main(cfg, rollout_fn_factory=lambda: None, rows=[{"prompt": "a"}])["exit_code"] == 2
    assert capsys.readouterr().err.startswith("fleetrl.main: rollout_fn_factory: ")


def test_a_mixture_source_that_cannot_be_read_is_refused_naming_its_index(tmp_path, capsys, monkeypatch):
    (tmp_path / "easy.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    sources = [{"path": str(tmp_path / "easy.jsonl")}, {"path": str(tmp_path / "broken.jsonl")}]
    config = set_fields(write_config(tmp_path), run={"dataset": None, "datasets": sources})
    err = refused(config, capsys, monkeypatch, "run.datasets[1].path: ")
    assert "broken.jsonl:2: not valid JSON" in err
    sources[1] = {"path": str(tmp_path / "easy.jsonl"), "name": "again"}
    starts(set_fields(config, run={"datasets": sources}), capsys, monkeypatch)


@pytest.mark.parametrize(
    ("cursor", "mixture", "prefix"),
    [([0, 4], True, "run.datasets: the run in"), ({"draws": 4, "sources": {}}, False, "run.dataset: the run in")],
)
def test_resuming_one_dataset_as_a_mixture_or_back_is_refused_at_start(
    tmp_path, capsys, monkeypatch, cursor, mixture, prefix
):
    # Before: the controller started and failed restoring its cursor (a traceback), after every other service.
    from fleetrl.controller.journal import Journal

    (tmp_path / "easy.jsonl").write_text('{"prompt": "a"}\n')
    journal = Journal(tmp_path / "run" / "controller.sqlite")
    journal.set_state("cursor", cursor)
    journal.close()
    run = {"dataset": None, "datasets": [{"path": str(tmp_path / "easy.jsonl")}]} if mixture else {}
    config = set_fields(write_config(tmp_path), run=run)
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"fleetrl up: {prefix}") and "--overwrite" in err, err
