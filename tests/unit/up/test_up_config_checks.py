"""`fleetrl up`'s config check catches what used to surface late or as a traceback (issue 28, item 10): a missing or
unreadable dataset (found only after every service started: exit 1 after 18 s), a log_path that is a file (a
traceback), and a full disk while the run goes on (a traceback; now a message saying --resume continues)."""

from __future__ import annotations

import errno
import json

import pytest

from fleetrl.up import run as up_run


def write_config(tmp_path, rollout="rollout.py:make_rollout_fn", **run):
    rows = tmp_path / "rows.jsonl"
    if not rows.exists():
        rows.write_text('{"prompt": "a"}\n')
    if not (tmp_path / "rollout.py").exists():
        (tmp_path / "rollout.py").write_text("def make_rollout_fn(setup):\n    return None\n")
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    data = {"base_model": str(model), "dataset": str(rows), "log_path": str(tmp_path / "run"), **run}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": data, "up": {"rollout": rollout}}))
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "no such dataset file"),
        ("garbage.jsonl", "not json at all\n", "garbage.jsonl:1: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", "list.jsonl:1: each row must be a JSON object"),
        ("empty.jsonl", "\n\n", "the dataset has no rows"),
        ("rows.parquet", "not parquet", "not a Parquet file"),
        # Issue 45: a broken line after the first was found by the controller after every service started.
        (
            "late.jsonl",
            '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n{"prompt": "d"}\n',
            "late.jsonl:3: not valid JSON",
        ),
        ("late_list.jsonl", '{"prompt": "a"}\n[1]\n', "late_list.jsonl:2: each row must be a JSON object"),
    ],
)
def test_a_bad_or_missing_dataset_fails_the_config_check(tmp_path, capsys, monkeypatch, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    config = write_config(tmp_path, dataset=str(tmp_path / name))
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err
    assert "run.dataset:" in err and message in err


def test_a_bad_eval_dataset_fails_the_config_check(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path, eval_dataset=str(tmp_path / "held_out.jsonl"))
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    assert "run.eval_dataset:" in capsys.readouterr().err


def test_a_log_path_that_is_a_file_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "run").write_text("a file\n")
    config = write_config(tmp_path)
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_full_disk_is_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path)

    def launch(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(up_run, "launch", launch)
    assert up_run.main([str(config)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "--resume" in err


def test_a_huge_completions_per_prompt_is_refused_naming_the_field(tmp_path, capsys, monkeypatch):
    # 1e11 was accepted and the gateway crash-looped on its first row.
    config = write_config(tmp_path, completions_per_prompt=int(1e11))
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    assert "run.completions_per_prompt = 100000000000: at most 65536" in capsys.readouterr().err


def test_the_gateway_refuses_it_too():
    from fleetrl import Config
    from fleetrl.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match=r"run\.completions_per_prompt"):
        GatewayConfig(run=Config(completions_per_prompt=10**11), rollout="m:f")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d.mkdir(), "an empty folder, not a dataset"),
        (lambda d: (d.mkdir(), (d / "notes.txt").write_text("x")), "not a folder written by Dataset.save_to_disk"),
        (
            lambda d: (d.mkdir(), (d / "dataset_dict.json").write_text('{"splits": ["test"]}')),
            "no split 'train' (splits: test)",
        ),
    ],
    ids=["empty", "other-files", "no-train-split"],
)
def test_a_dataset_folder_that_holds_no_dataset_fails_the_config_check(tmp_path, capsys, monkeypatch, make, message):
    # Issue 45: an empty folder as the dataset started every service and failed 25 s later with a traceback.
    make(tmp_path / "rows_folder")
    config = write_config(tmp_path, dataset=str(tmp_path / "rows_folder"))
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run.dataset:" in err and message in err


@pytest.mark.parametrize(
    ("rollout", "module", "message"),
    [
        ("missing.py:make_rollout_fn", None, "no such file"),
        ("rollout.py:make_rollout_fun", None, "has no attribute 'make_rollout_fun'"),
        ("no_such_module_45:make", None, "cannot import module 'no_such_module_45'"),
        ("broken.py:make", "import no_such_dependency_45\n", "ModuleNotFoundError"),
        ("syntax.py:make", "def make(:\n", "SyntaxError"),
        ("constant.py:make", "make = 3\n", "is a int, not a callable"),
    ],
)
def test_a_bad_rollout_fails_the_config_check_before_any_service_starts(
    tmp_path, capsys, monkeypatch, rollout, module, message
):
    # Issue 45: a bad `[up] rollout` path started the services and the run failed 15 s later (rc 1).
    if module is not None:
        (tmp_path / rollout.split(":")[0]).write_text(module)
    config = write_config(tmp_path, rollout=rollout)
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("fleetrl up: up.rollout:") and message in err
    assert not (tmp_path / "run").exists()  # refused before the run's folder was touched


def test_a_rollout_module_beside_the_config_is_found_as_the_gateways_find_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_rollouts_45.py").write_text("def make(setup):\n    return None\n")
    config = write_config(tmp_path, rollout="my_rollouts_45:make")
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: 0)
    assert up_run.main([str(config)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("field", ["evaluation", "dynamic_filter"])
def test_a_bad_evaluation_hook_or_filter_fails_the_config_check(tmp_path, capsys, monkeypatch, field):
    config = write_config(tmp_path, eval_dataset=str(tmp_path / "rows.jsonl"))
    data = json.loads(config.read_text())
    (tmp_path / f"hooks_45_{field}.py").write_text("def hook(*args):\n    return True\n")
    data["up"][field] = f"hooks_45_{field}:no_such_hook"  # a module beside the config, as the gateways import it
    config.write_text(json.dumps(data))
    monkeypatch.setattr(up_run, "launch", lambda *a, **k: pytest.fail("services were started"))
    assert up_run.main([str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"fleetrl up: up.{field}:")
        and f"module 'hooks_45_{field}' has no attribute 'no_such_hook'" in err
    )
