"""The tracker names `[run] loggers` accepts and the optional extra each needs. Pure: imports no backend."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

LOGGER_NAMES: tuple[str, ...] = ("jsonl", "wandb", "tensorboard", "mlflow")
"""jsonl is always on (metrics.jsonl, samples.jsonl, config.json); the others are optional backends."""
BACKEND_MODULES: dict[str, str] = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}
"""The module each optional backend imports (all three come with `pip install fleetrl[trackers]`)."""


def check_logger_names(names: Sequence[str]) -> list[str]:
    """`loggers` with jsonl first and no repeats; ValueError naming an unknown tracker."""
    unknown = [n for n in names if n not in LOGGER_NAMES]
    if unknown:
        raise ValueError(f"loggers: unknown tracker {unknown[0]!r}; choose from {list(LOGGER_NAMES)}")
    return ["jsonl", *dict.fromkeys(n for n in names if n != "jsonl")]


def missing_extra(name: str) -> str | None:
    """The message for a backend whose client library is not installed, or None when it is."""
    module = BACKEND_MODULES.get(name)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return f"loggers: {name!r} needs `pip install fleetrl[trackers]` (no module named {module!r})"
