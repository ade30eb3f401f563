"""Weights & Biases tracker (the `wandb` client; `WANDB_MODE=offline` logs to local files for a later `wandb sync`).

The run id is kept in `<log_path>/wandb_run_id`: `fleetrl up --resume` continues the same W&B run
(`wandb.init(id=..., resume="allow")`); a fresh run gets a new id. Every metric is plotted against the run's
`step` (`define_metric(step_metric="step")`), not W&B's own call counter, so an evaluation that reports after the
next step, and the steps a resumed run trains again, land at their own step instead of being dropped as out of order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetrl.sample_log import SAMPLE_COLUMNS
from fleetrl.trackers.base import RUN_ID_FILES, Tracker, numeric


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(
        self,
        log_dir: Path,
        *,
        project: str,
        entity: str | None = None,
        run_name: str | None = None,
        tags: Sequence[str] = (),
        resume: bool = False,
    ) -> None:
        import wandb

        self._wandb = wandb
        id_file = log_dir / RUN_ID_FILES["wandb"]
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        if not run_id:
            from wandb.sdk.lib.runid import generate_id

            run_id = generate_id()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name or log_dir.resolve().name,
            tags=list(tags) or None,
            id=run_id,
            resume="allow",
            # The run's files go in the log folder unless WANDB_DIR says otherwise.
            dir=None if os.environ.get("WANDB_DIR") else str(log_dir),
            # The controller's own logs stay as they are: W&B does not wrap its stdout and stderr.
            settings=wandb.Settings(console="off", silent=True),
        )
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def run_id(self) -> str:
        return str(self.run.id)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({**numeric(metrics), "step": step})

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table, "step": step})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
