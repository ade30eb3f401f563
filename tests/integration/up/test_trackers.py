"""A short real run with `loggers = ["wandb", "tensorboard", "mlflow"]` and samples every step: W&B (offline),
TensorBoard and MLflow (a local file store) each receive the config, every per-step line and the samples, read back
with the backend's own reader; the run folder holds config.json and samples.jsonl; every key the run writes is in
docs/metrics.md; and `fleetrl up --resume` continues the same W&B and MLflow runs."""

from __future__ import annotations

import json

import pytest

from tests.deploy.test_metrics_docs import undocumented_step_keys
from tests.integration.up.conftest import fleetrl_up, read_metrics, write_run
from tests.unit.trackers.readers import (
    read_wandb_run,
    tensorboard_events,
    tensorboard_scalars,
    tensorboard_text,
    wandb_run_files,
    wandb_table,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_tracker_gets_the_run_and_a_resume_continues_it(tmp_path, tiny_model_dir, monkeypatch):
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")  # inherited by `fleetrl up` and its controller
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    run_cfg = {
        "loggers": ["wandb", "tensorboard", "mlflow"],
        "log_samples_interval": 1,
        "log_samples_count": 2,
        "max_steps": 2,
        "wandb_project": "fleetrl-ci",
        "wandb_tags": ["integration"],
    }
    config = write_run(tmp_path, tiny_model_dir, run_cfg, {}, n_rows=12)
    run_dir = tmp_path / "run"
    result = fleetrl_up(config)
    assert result.returncode == 0, result.stderr[-3000:]

    lines = read_metrics(run_dir)
    steps = [m for m in lines if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert not undocumented_step_keys(lines), "keys missing from docs/metrics.md's per-step table"
    assert json.loads((run_dir / "config.json").read_text())["loggers"] == ["jsonl", "wandb", "tensorboard", "mlflow"]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    assert all(s["prompt"].startswith("count ") and isinstance(s["reward"], float) for s in samples)

    # W&B: config, a history row per step at its step, and the samples tables, in the offline run file.
    (run_file,) = wandb_run_files(wandb_dir)
    wandb_run = read_wandb_run(run_file)
    assert wandb_run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    assert wandb_run.project == "fleetrl-ci" and wandb_run.tags == ["integration"] and wandb_run.name == "run"
    assert wandb_run.config["max_steps"] == 2
    logged = {row["step"]: row for row in wandb_run.history if "train/loss" in row}
    assert {s: row["train/loss"] for s, row in logged.items()} == {m["step"]: m["train/loss"] for m in steps}
    for m, row in zip(steps, logged.values(), strict=True):
        assert row["rollout/raw_reward"] == m["rollout/raw_reward"]
    tables = [wandb_table(run_file, row) for row in wandb_run.history if "samples/path" in row]
    assert [row[2] for table in tables for row in table["data"]] == [s["prompt"] for s in samples]

    # TensorBoard: the same scalars at the same steps, the config and the samples as text.
    events = tensorboard_events(run_dir / "tensorboard")
    assert tensorboard_scalars(events, "optim/entropy") == pytest.approx({m["step"]: m["optim/entropy"] for m in steps})
    assert '"max_steps": 2' in tensorboard_text(events, "config")[0]
    assert sorted(tensorboard_text(events, "samples")) == [1, 2]

    # MLflow: metrics by step, params, the samples artifacts.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when asked
    mlflow_run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run_id, "train/loss")}
    assert history == pytest.approx({m["step"]: m["train/loss"] for m in steps})
    assert client.get_run(mlflow_run_id).data.params["max_steps"] == "2"
    assert [a.path for a in client.list_artifacts(mlflow_run_id, "samples")] == [
        "samples/step_000001.json",
        "samples/step_000002.json",
    ]

    # --resume with one more step: the same W&B and MLflow runs go on.
    resumed = fleetrl_up(config, extra=["--resume", "--set", "max_steps=3"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == [1, 2, 3]
    (second,) = set(wandb_run_files(wandb_dir)) - {run_file}
    continued = read_wandb_run(second)
    assert continued.run_id == wandb_run.run_id
    assert [row["step"] for row in continued.history if "train/loss" in row] == [3]
    assert (run_dir / "mlflow_run_id").read_text().strip() == mlflow_run_id
    assert sorted(m.step for m in client.get_metric_history(mlflow_run_id, "train/loss")) == [1, 2, 3]
