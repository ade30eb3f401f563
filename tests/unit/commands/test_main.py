"""The `fleetrl` command line as a user meets it: help, version, clean config errors, --set on [up], missing models.

Everything runs through `fleetrl.commands.main.main([...])` (one test through a real subprocess, for the traceback
check); every `fleetrl up` here fails its config check before any service starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl import __version__
from fleetrl.commands.main import COMMANDS, SERVICES, main
from fleetrl.model_path import ModelNotFoundError, check_model_path, looks_like_path
from fleetrl.up.config import load_run_and_up

REPO = Path(__file__).resolve().parents[3]


def write_run(tmp_path: Path, run: dict | None = None, up: dict | None = None) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    base = {"base_model": str(model), "dataset": "rows.jsonl", "log_path": str(tmp_path / "run"), "max_steps": 5}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {**base, **(run or {})}, "up": {"rollout": "m:f", **(up or {})}}))
    return path


def test_help_describes_each_command_in_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out.splitlines()
    for name, line in COMMANDS.items():
        assert any(row.split() == [name, *line.split()] for row in out), (name, out)


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fleetrl {__version__}"


def test_serve_help_lists_the_services(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for name, line in SERVICES.items():
        assert f"{name}  " in out and line in out


def test_unknown_service_is_a_usage_error(capsys):
    assert main(["serve", "trainr"]) == 2
    assert "unknown service 'trainr'" in capsys.readouterr().err


def test_demo_bad_loss_is_one_clean_line_not_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "demo", "--loss", "bogus", "--steps", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "pydantic" not in result.stderr
    assert result.stderr.startswith("fleetrl demo: invalid config")
    assert "policy_loss 'bogus' is not one of" in result.stderr


def test_unknown_set_key_suggests_the_field_and_blames_the_flag(tmp_path, capsys):
    config = write_run(tmp_path)
    assert main(["up", str(config), "--set", "max_step=3"]) == 2
    err = capsys.readouterr().err
    assert "--set: invalid config" in err and "max_step: unknown field, did you mean max_steps?" in err
    assert str(config) not in err  # the file is fine: the flag is wrong


def test_unknown_key_in_the_file_blames_the_file(tmp_path, capsys):
    config = write_run(tmp_path, run={"max_step": 3})
    assert main(["up", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{config}: invalid config" in err and "max_step: unknown field, did you mean max_steps?" in err


def test_set_reaches_the_up_table(tmp_path, capsys):
    config = write_run(tmp_path)
    run, up, run_sets = load_run_and_up(config, ["up.engine=vllm", "up.replicas=2", "seed=7"])
    assert (up.engine, up.replicas, run.seed) == ("vllm", 2, 7)
    assert run_sets == ["seed=7"]  # what the services are started with: [up] keys are fleetrl up's own
    assert main(["up", str(config), "--set", "up.engin=vllm"]) == 2
    err = capsys.readouterr().err
    assert "--set: invalid [up] table" in err and "up.engin: unknown field, did you mean engine?" in err
    assert main(["up", str(config), "--set", "up.engine=sglang"]) == 2
    assert "up.engine: Input should be 'hf' or 'vllm'" in capsys.readouterr().err


def test_a_missing_model_path_says_so_before_anything_starts(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such" / "model")
    config = write_run(tmp_path, run={"base_model": missing})
    assert main(["up", str(config)]) == 2
    assert capsys.readouterr().err.strip() == f"fleetrl up: run.base_model: no model at {missing}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("name", "is_path"),
    [
        ("Qwen/Qwen2.5-0.5B", False),
        ("gpt2", False),
        ("./runs/x/final", True),
        ("runs/arithmetic/init/model", True),
        ("/abs/model", True),
        ("~/model", True),
        ("a b", True),
    ],
)
def test_what_looks_like_a_path(name, is_path):
    assert looks_like_path(name) is is_path


def test_check_model_path(tmp_path):
    check_model_path(str(tmp_path))  # exists
    check_model_path("Qwen/Qwen2.5-0.5B")  # a hub id: left to the hub
    with pytest.raises(ModelNotFoundError, match=r"^run.base_model: no model at \./nope/m$"):
        check_model_path("./nope/m", "run.base_model")


def test_load_causal_lm_says_no_model_at_path(tmp_path):
    from fleetrl.trainer.model import load_causal_lm, load_tokenizer

    missing = str(tmp_path / "gone")
    with pytest.raises(ModelNotFoundError, match=f"^no model at {missing}$"):
        load_causal_lm(missing)
    with pytest.raises(ModelNotFoundError, match="no model at"):
        load_tokenizer(missing)


def make_rollout_fn(setup):  # only named: the run stops before any service starts
    raise AssertionError("not called")


def test_fleetrl_main_says_no_model_at_path_before_starting_anything(tmp_path, capsys):
    import fleetrl
    from fleetrl import Config

    missing = str(tmp_path / "none")
    cfg = Config(base_model=missing, log_path=str(tmp_path / "run"))
    assert fleetrl.main(cfg, rollout_fn_factory=make_rollout_fn, rows=[{"prompt": "x"}])["exit_code"] == 2
    assert f"base_model: no model at {missing}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("service", ["trainer", "reference"])
def test_serving_a_missing_model_path_says_so(tmp_path, capsys, service):
    missing = str(tmp_path / "no" / "model")
    argv = ["serve", service, "--model", missing, "--grpc-port", "0"]
    assert main([*argv, *(["--set", "kl_beta=0"] if service == "trainer" else [])]) != 0
    err = capsys.readouterr().err
    assert err.strip().endswith(f": no model at {missing}") and "Traceback" not in err
