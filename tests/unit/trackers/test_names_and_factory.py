"""`[run] loggers`: names checked at config load, a missing extra named at start, a tracker that cannot start
fails the start (and closes the ones already started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetrl.config import Config, ConfigError
from fleetrl.trackers import TrackerError, make_trackers
from fleetrl.trackers import names as tracker_names
from fleetrl.trackers.jsonl import JsonlTracker


def test_jsonl_is_always_on_and_names_are_deduplicated():
    cfg = Config(loggers=["tensorboard", "wandb", "tensorboard"])
    assert cfg.loggers == ["jsonl", "tensorboard", "wandb"]
    assert Config().loggers == ["jsonl"]


def test_an_unknown_tracker_fails_at_load_naming_the_field():
    with pytest.raises(ConfigError) as err:
        Config.load({"loggers": ["jsonl", "neptune"]}, source="run.toml")
    assert "loggers" in str(err.value) and "'neptune'" in str(err.value) and "wandb" in str(err.value)


def test_a_missing_extra_is_named(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(tracker_names.BACKEND_MODULES, "wandb", "fleetrl_no_such_module")
    cfg = Config(loggers=["wandb"], log_path=str(tmp_path))
    with pytest.raises(TrackerError, match=r"loggers: 'wandb' needs `pip install fleetrl\[trackers\]`"):
        make_trackers(cfg)
    assert not (tmp_path / "wandb_run_id").exists()


def test_a_tracker_that_cannot_start_fails_the_start_and_closes_the_others(monkeypatch, tmp_path: Path):
    closed: list[bool] = []
    monkeypatch.setattr(JsonlTracker, "close", lambda self, failed=False: closed.append(failed))
    # An MLflow URI no store answers to: the client fails when the run is created.
    cfg = Config(loggers=["mlflow"], log_path=str(tmp_path), mlflow_tracking_uri="bogus-scheme://nowhere")
    with pytest.raises(TrackerError, match=r"loggers: 'mlflow' could not start"):
        make_trackers(cfg)
    assert closed == [True]


def test_the_default_set_is_the_jsonl_record(tmp_path: Path):
    trackers = make_trackers(Config(log_path=str(tmp_path)))
    assert trackers.names == ["jsonl"]
    trackers.log_config({"seed": 0})
    trackers.log_metrics(1, {"step": 1, "train/loss": 0.5})
    trackers.log_samples(1, [{"step": 1, "prompt": "p", "completion": "c"}])
    trackers.close()
    assert (tmp_path / "config.json").read_text().strip().startswith("{")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 0.5}\n'
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1, "prompt": "p", "completion": "c"}\n'


def test_fleetrl_up_names_a_missing_extra_before_starting_anything(monkeypatch, tmp_path, capsys):
    import json

    from fleetrl.up.run import main

    monkeypatch.setitem(tracker_names.BACKEND_MODULES, "mlflow", "fleetrl_no_such_module")
    log_dir = tmp_path / "run"
    run = {"base_model": "m", "log_path": str(log_dir), "loggers": ["mlflow"]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": run, "up": {"rollout": "m:f"}}))
    assert main([str(path)]) == 2
    assert "fleetrl up: loggers: 'mlflow' needs `pip install fleetrl[trackers]`" in capsys.readouterr().err
    assert not log_dir.exists()
