"""The always-on tracker: the run folder's own files, `metrics.jsonl`, `samples.jsonl` and `config.json`."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetrl.trackers.base import Tracker

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"


class JsonlTracker(Tracker):
    """Appends each metrics line to `metrics_path` and each sample to `<log_dir>/samples.jsonl`; writes the
    resolved config to `<log_dir>/config.json`."""

    name = "jsonl"
    required = True

    def __init__(self, log_dir: Path, metrics_path: Path) -> None:
        self.log_dir = log_dir
        self.metrics_path = metrics_path

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / CONFIG_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._append(self.metrics_path, [metrics])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self._append(self.log_dir / SAMPLES_FILE, rows)

    @staticmethod
    def _append(path: Path, lines: Sequence[Mapping[str, Any]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(dict(line)) + "\n" for line in lines)
