"""Is a model name a local folder that is not there? Then say "no model at PATH", not a hub error.

    check_model_path(cfg.base_model)   # raises ModelNotFoundError("no model at ./runs/x/final") for a missing folder

A name is taken as a path when it cannot be a hub id (`org/name`): it is absolute, starts with `.` or `~`, has
more than one `/`, or has characters a hub id cannot. `org/name` that is no local folder is left to the hub.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


class ModelNotFoundError(ValueError):
    """A model name that is a local path with no model there."""


def looks_like_path(name: str) -> bool:
    """True when `name` can only be a local path (never a hub id)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        return True
    return not _HUB_ID.match(name) or "--" in name or ".." in name


def missing_model_path(name: str) -> str | None:
    """The message for a path-looking `name` with no folder or file there, else None."""
    if not name or not looks_like_path(name):
        return None
    path = Path(name).expanduser()
    return None if path.exists() else f"no model at {name}"


def check_model_path(name: str, field: str | None = None) -> None:
    """Raise `ModelNotFoundError` ("[field: ]no model at PATH") for a path-looking `name` that does not exist."""
    message = missing_model_path(name)
    if message is not None:
        raise ModelNotFoundError(f"{field}: {message}" if field else message)


def adapter_instead_of_model(name: str) -> str | None:
    """The message for a local folder that holds a PEFT adapter rather than a model (`adapter_config.json` and no
    `config.json`), else None: such a folder is not a base model, and loading it as one trained nothing before."""
    path = Path(name).expanduser() if name else None
    if path is None or not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return None
    base = ""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # the hint is optional
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    base_hint = f"its base model ({base})" if base else "its base model"
    return (
        f"{name} is a PEFT adapter (adapter_config.json), not a model: set base_model to {base_hint} and "
        f"warm_start_from_adapter = {name!r} with lora_rank equal to the adapter's rank"
    )
