"""The sources of a dataset mixture (`run.datasets`): several datasets drawn from by weight, each weight optionally
changing with the step (a schedule), each source optionally filtered on a per-row difficulty field.

    [[run.datasets]]
    path = "easy.jsonl"
    weight = 3.0
    weight_schedule = [[1, 3.0], [200, 0.5]]   # (step, weight) points, linear in between, flat outside

    [[run.datasets]]
    path = "hard.jsonl"
    name = "hard"
    difficulty_field = "level"
    min_difficulty = 3

The controller draws rows by these weights and journals every source's cursor (fleetrl.controller.mixture). This
module is the config's part only: pydantic models and checks, no rows. Shared by the config, `fleetrl up`'s start
checks and the controller.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class DatasetSource(BaseModel):
    """One dataset of a mixture."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str = Field(..., description="The rows: a JSONL or Parquet file, a save_to_disk folder or a cached hub id.")
    name: str | None = Field(
        None, description="The source's name in metrics (data/<name>/...); None = the file's stem. Unique."
    )
    weight: float = Field(1.0, gt=0, description="Relative share of the rows drawn (the weights need not sum to 1).")
    weight_schedule: list[tuple[int, float]] | None = Field(
        None,
        description="(step, weight) points: the weight at a step is interpolated linearly between them and flat "
        "outside (0 stops the source while it holds); the step is the one a draw nominally fills "
        "(draws // prompt_groups_per_step + 1), so the same run draws the same rows. None = weight throughout.",
    )
    difficulty_field: str | None = Field(
        None,
        description="A numeric field of each row; with min_difficulty / max_difficulty only rows in range are drawn.",
    )
    min_difficulty: float | None = Field(None, description="Rows whose difficulty_field is below this are skipped.")
    max_difficulty: float | None = Field(None, description="Rows whose difficulty_field is above this are skipped.")

    @model_validator(mode="after")
    def _check(self) -> DatasetSource:
        if not self.path.strip():
            raise ValueError("path: name the source's rows")
        if self.name is not None and not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: letters, digits, '_', '.' or '-' only (it names metrics)")
        if self.weight_schedule is not None:
            steps = [step for step, _ in self.weight_schedule]
            if not steps:
                raise ValueError("weight_schedule: give (step, weight) points, or leave it unset")
            if steps != sorted(set(steps)) or steps[0] < 1:
                raise ValueError(f"weight_schedule: steps must be >= 1 and increasing, got {steps}")
            if any(not math.isfinite(w) or w < 0 for _, w in self.weight_schedule):
                raise ValueError("weight_schedule: weights must be finite and >= 0")
        bounds = self.min_difficulty is not None or self.max_difficulty is not None
        if bounds and not self.difficulty_field:
            raise ValueError("min_difficulty / max_difficulty: name the rows' difficulty_field")
        if self.difficulty_field and not bounds:
            raise ValueError("difficulty_field: give min_difficulty and/or max_difficulty (the range to draw)")
        low, high = self.min_difficulty, self.max_difficulty
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_difficulty ({low}) must be <= max_difficulty ({high})")
        return self

    @property
    def source_name(self) -> str:
        """The name metrics use: `name`, else the path's stem."""
        return self.name or Path(self.path.rstrip("/")).stem or self.path


def check_sources(sources: list[DatasetSource]) -> None:
    """Cross-source rules: at least one source, and names (given or from the paths) unique. ValueError naming the
    field."""
    if not sources:
        raise ValueError("datasets: name at least one source, or leave it unset and use dataset")
    names = [s.source_name for s in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"datasets: the source names {repeated} repeat: give each source its own name")
