"""`fleetrl up`'s config check catches what used to surface late or as a traceback (issue 28, item 10): a missing or
unreadable dataset (found only after every service started: exit 1 after 18 s), a log_path that is a file (a
traceback), and a full disk while the run goes on (a traceback; now a message saying --resume continues)."""

from __future__ import annotations

import errno
import json

import pytest

from fleetrl.up import run as up_run


def write_config(tmp_path, **run):
    rows = tmp_path / "rows.jsonl"
    if not rows.exists():
        rows.write_text('{"prompt": "a"}\n')
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    data = {"base_model": str(model), "dataset": str(rows), "log_path": str(tmp_path / "run"), **run}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": data, "up": {"rollout": "m:f"}}))
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "no such dataset file"),
        ("garbage.jsonl", "not json at all\n", "garbage.jsonl:1: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", "list.jsonl:1: each row must be a JSON object"),
        ("empty.jsonl", "\n\n", "the dataset has no rows"),
        ("rows.parquet", "not parquet", "not a Parquet file"),
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
