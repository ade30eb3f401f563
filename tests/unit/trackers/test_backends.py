"""Each backend with its real client library and no network (W&B offline, TensorBoard event files, an MLflow file
store), read back with the backend's own reader: what a run logs arrives, and a resumed run continues the same
W&B and MLflow run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetrl.config import Config
from fleetrl.trackers import make_trackers
from fleetrl.trackers.mlflow_tracker import mlflow_key
from tests.unit.trackers.readers import (
    read_wandb_run,
    tensorboard_events,
    tensorboard_scalars,
    tensorboard_text,
    wandb_run_files,
    wandb_table,
)

LINE_1 = {"step": 1, "version": 1, "time": 1.0, "train/loss": 0.5, "rollout/raw_reward": 0.25, "note": "text"}
LINE_2 = {"step": 2, "version": 2, "time": 2.0, "train/loss": 0.4, "rollout/raw_reward": 0.5}
EVAL_0 = {"step": 0, "version": 0, "time": 3.0, "eval/accuracy": 0.125}  # an evaluation reported late
SAMPLE = {
    "step": 2,
    "row_id": 7,
    "prompt": "count 1 to 4:",
    "completion": " 1 2 3 4",
    "reward": 1.0,
    "version_offset": 1,
    "finish_reason": "stop",
}


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path: Path) -> Path:
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return wandb_dir


def run_once(cfg: Config, resume: bool = False, lines=(LINE_1, LINE_2, EVAL_0)) -> None:
    trackers = make_trackers(cfg, resume=resume)
    trackers.log_config(cfg.model_dump(mode="json"))
    for line in lines:
        trackers.log_metrics(int(line["step"]), line)
    trackers.log_samples(2, [SAMPLE])
    trackers.close()
    assert trackers.total_failures == 0


def test_wandb_offline_gets_config_metrics_samples_and_a_resume_continues_the_run(offline_wandb, tmp_path):
    cfg = Config(
        log_path=str(tmp_path / "run"),
        loggers=["wandb"],
        wandb_project="proj",
        wandb_run_name="first-try",
        wandb_tags=["ci", "tiny"],
        seed=3,
    )
    run_once(cfg)
    (first,) = wandb_run_files(offline_wandb)
    run = read_wandb_run(first)
    assert run.project == "proj" and run.name == "first-try" and run.tags == ["ci", "tiny"]
    assert run.run_id == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert run.config["seed"] == 3 and run.config["loggers"] == ["jsonl", "wandb"]
    losses = {row["step"]: row["train/loss"] for row in run.history if "train/loss" in row}
    assert losses == {1: 0.5, 2: 0.4}
    assert all("time" not in row and "note" not in row for row in run.history)  # not plotted
    (evaluation,) = [row for row in run.history if "eval/accuracy" in row]
    assert evaluation["step"] == 0 and evaluation["eval/accuracy"] == 0.125  # kept, though after step 2
    (logged,) = [row for row in run.history if "samples/path" in row]
    table = wandb_table(first, logged)
    assert table["columns"][:3] == ["step", "row_id", "prompt"]
    assert table["data"][0][1:4] == [7, "count 1 to 4:", " 1 2 3 4"]

    run_once(cfg, resume=True, lines=[{**LINE_2, "step": 3, "version": 3}])
    (second,) = set(wandb_run_files(offline_wandb)) - {first}  # offline, a resume writes a file of the same run
    resumed = read_wandb_run(second)
    assert resumed.run_id == run.run_id
    assert [row["step"] for row in resumed.history if "train/loss" in row] == [3]

    run_once(cfg, resume=False, lines=[LINE_1])  # a fresh run in the same folder is a new W&B run
    (third,) = set(wandb_run_files(offline_wandb)) - {first, second}
    assert read_wandb_run(third).run_id not in ("", run.run_id)


def test_tensorboard_event_files_hold_scalars_config_and_samples(tmp_path):
    cfg = Config(log_path=str(tmp_path / "run"), loggers=["tensorboard"], seed=5)
    run_once(cfg)
    events = tensorboard_events(tmp_path / "run" / "tensorboard")
    assert tensorboard_scalars(events, "train/loss") == pytest.approx({1: 0.5, 2: 0.4})
    assert tensorboard_scalars(events, "eval/accuracy") == {0: 0.125}
    assert "time" not in events.Tags()["scalars"] and "step" not in events.Tags()["scalars"]
    assert '"seed": 5' in tensorboard_text(events, "config")[0]
    table = tensorboard_text(events, "samples")[2]
    assert "| 2 | 7 | count 1 to 4: |  1 2 3 4 | 1.0 | 1 | stop |" in table


def test_mlflow_file_store_holds_metrics_params_samples_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the tracker opts in for its default store

    cfg = Config(log_path=str(tmp_path / "run"), loggers=["mlflow"], mlflow_experiment="exp", seed=9)
    run_once(cfg)
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "exp" and run.info.status == "FINISHED"
    assert run.data.params["seed"] == "9" and run.data.params["loggers"] == "['jsonl', 'mlflow']"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == pytest.approx({1: 0.5, 2: 0.4})
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(0, 0.125)]
    assert "time" not in run.data.metrics
    samples = client.download_artifacts(run_id, "samples/step_000002.json", str(tmp_path))
    assert '"count 1 to 4:"' in Path(samples).read_text()
    assert '"seed": 9' in Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text()

    run_once(cfg.model_copy(update={"seed": 10}), resume=True, lines=[{**LINE_2, "step": 3, "version": 3}])
    assert (tmp_path / "run" / "mlflow_run_id").read_text().strip() == run_id
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert sorted(history) == [1, 2, 3]
    assert client.get_run(run_id).data.params["seed"] == "9"  # params are the start's; config.json the latest


def test_mlflow_keys_keep_slashes_and_replace_what_mlflow_refuses():
    assert mlflow_key("env/all/reward-total.v2") == "env/all/reward-total.v2"
    assert mlflow_key("env/all/acc@1") == "env/all/acc_1"
