"""Import paths of modules that moved into their role's package keep working: `import fleetrl.sampler` gives the
module `fleetrl.gateway.sampler` itself (the same object, so its classes and module state are shared), imported
only when first asked for. `fleetrl/__init__.py` installs the finder; tests/unit/test_moved_modules.py checks every
old path."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "fleetrl.gate": "fleetrl.controller.gate",
    "fleetrl.membership": "fleetrl.inference.membership",
    "fleetrl.advantages": "fleetrl.trainer.advantages",
    "fleetrl.datum": "fleetrl.trainer.datum",
    "fleetrl.sampler": "fleetrl.gateway.sampler",
    "fleetrl.sampler_coalesce": "fleetrl.gateway.sampler_coalesce",
    "fleetrl.sampling_seed": "fleetrl.gateway.sampling_seed",
    "fleetrl.up.evaluate": "fleetrl.commands.evaluate",
    "fleetrl.up.status": "fleetrl.commands.status",
}
"""Old path -> the module's home."""


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one, leaving that module's own spec in place."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec on the shared module


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """A meta path finder for the old paths in MOVED (nothing else)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on `sys.meta_path` once."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
