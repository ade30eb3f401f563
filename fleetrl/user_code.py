"""Loading user code named on the command line: `package.module:attr` or `path/to/file.py:attr`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(spec: str) -> Any:
    """The object `attr` of the module named by `spec`; a clear error naming what was not found."""
    if ":" not in spec:
        raise ValueError(f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    module_name, attr = spec.rsplit(":", 1)
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ValueError(f"{spec!r}: no such file {path}")
        name = f"fleetrl_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{spec!r}: cannot load {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        sys.path.insert(0, str(path.parent))  # let the file import its neighbours (reward.py, ...)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ValueError(f"{spec!r}: cannot import module {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}") from None
