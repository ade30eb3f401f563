"""TensorBoard tracker: event files in `<log_path>/tensorboard` (`tensorboard --logdir <log_path>/tensorboard`).

Scalars per metric at their step, the config as text at step 0, samples as a markdown table (the text plugin)
at their step. A resumed run appends a new event file to the same folder; TensorBoard shows the latest value of a
step that was trained again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetrl.sample_log import SAMPLE_COLUMNS
from fleetrl.trackers.base import Tracker, numeric, samples_markdown

TENSORBOARD_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = log_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.path))

    def log_config(self, config: Mapping[str, Any]) -> None:
        text = "```json\n" + json.dumps(dict(config), indent=2, sort_keys=True) + "\n```"
        self.writer.add_text("config", text, global_step=0)
        self.writer.flush()

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a step is seconds to minutes apart: a reader sees every step as it ends

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self.writer.add_text("samples", samples_markdown(rows, SAMPLE_COLUMNS), global_step=step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()
