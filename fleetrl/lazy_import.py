"""A package's names that load their module on first use (PEP 562): keeps heavy imports (torch, ZeroMQ) out of
the processes that only need a package's light parts (`fleetrl up`, the controller, config checks).

    __getattr__ = lazy_names(__name__, {"policy_loss": "policy"})   # fleetrl.losses.policy_loss on first use
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: name -> the submodule that defines it, imported when first asked."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
