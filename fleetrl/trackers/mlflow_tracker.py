"""MLflow tracker, through `mlflow.tracking.MlflowClient` (no global active run).

`mlflow_tracking_uri` None means a local file store in `<log_path>/mlruns` (`mlflow ui --backend-store-uri
file://<log_path>/mlruns`). The run id is kept in `<log_path>/mlflow_run_id`, so `fleetrl up --resume` logs into
the same MLflow run. The config goes in as params (a fresh run only: MLflow refuses to change a param) and as the
`config.json` artifact; samples as `samples/step_<step>.json` artifacts (columns and rows).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetrl.sample_log import SAMPLE_COLUMNS
from fleetrl.trackers.base import RUN_ID_FILES, Tracker, numeric

MLRUNS_DIR = "mlruns"
_BATCH = 100  # MLflow's limit on params per log_batch call (1000 for metrics)
_MAX_PARAM_CHARS = 6000


def mlflow_key(key: str) -> str:
    """MLflow keys hold letters, digits, `_ - . / :` and spaces; anything else (a user's env metric) becomes `_`."""
    return re.sub(r"[^\w\-./: ]", "_", key)


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(
        self, log_dir: Path, *, tracking_uri: str | None, experiment: str, run_name: str | None, resume: bool
    ) -> None:
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            tracking_uri = (log_dir.resolve() / MLRUNS_DIR).as_uri()
            # MLflow 3 refuses a file store unless asked: it is the serverless default here, chosen on purpose.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        id_file = log_dir / RUN_ID_FILES["mlflow"]
        run_id = id_file.read_text().strip() if resume and id_file.exists() else ""
        self.resumed = bool(run_id)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=run_name or log_dir.resolve().name)
            run_id = run.info.run_id
        self.run_id = run_id
        log_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_dict(self.run_id, dict(config), "config.json")
        if self.resumed:
            return
        params = [Param(mlflow_key(k), str(v)[:_MAX_PARAM_CHARS]) for k, v in sorted(config.items())]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), v, now, step) for k, v in numeric(metrics).items()]
        for i in range(0, len(items), 10 * _BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + 10 * _BATCH])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]}
        self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
