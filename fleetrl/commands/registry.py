"""The services a `fleetrl` command can start or probe, found through package entry points, never by module name.

The package declares them in pyproject.toml, one name per service in two groups:

    [project.entry-points."fleetrl.service_launchers"]   name -> the launcher's `main(argv) -> int`
    [project.entry-points."fleetrl.service_configs"]     name -> the service's pydantic config class

so the library names no service module: `fleetrl serve NAME` and `fleetrl health --auto` look NAME up here. The
entry points exist once the package is installed (`pip install -e .`). Every installed distribution's entry points
are read, not only the first distribution of each name that `importlib.metadata.entry_points()` keeps: a stale
`fleetrl.egg-info` in a source checkout (on sys.path as the current directory) would otherwise hide them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, distributions
from types import ModuleType
from typing import Any

LAUNCHERS = "fleetrl.service_launchers"
CONFIGS = "fleetrl.service_configs"


class UnknownServiceError(LookupError):
    """No entry point of that name; the message lists the known ones."""

    def __init__(self, name: str, group: str, known: list[str]) -> None:
        self.name, self.group, self.known = name, group, known
        if known:
            message = f"unknown service {name!r}; choose one of {', '.join(known)}"
        else:
            message = (
                f"unknown service {name!r}: no services are installed (no entry points in group {group!r}; "
                "install fleetrl with `pip install -e .`)"
            )
        super().__init__(message)


def group_entry_points(group: str) -> dict[str, EntryPoint]:
    """Name -> entry point of `group` across every installed distribution (the first found wins a name)."""
    found: dict[str, EntryPoint] = {}
    for dist in distributions():
        for point in dist.entry_points.select(group=group):
            found.setdefault(point.name, point)
    return found


def service_names(group: str = LAUNCHERS) -> list[str]:
    """The names of the services with an entry point in `group`, sorted."""
    return sorted(group_entry_points(group))


def entry_point(name: str, group: str = LAUNCHERS) -> EntryPoint:
    """The entry point `name` of `group`; raises UnknownServiceError listing the known names."""
    points = group_entry_points(group)
    if name not in points:
        raise UnknownServiceError(name, group, sorted(points))
    return points[name]


def launcher_main(name: str) -> Callable[[list[str]], Any]:
    """The `main(argv)` of service `name`'s launcher (imports the launcher)."""
    return entry_point(name, LAUNCHERS).load()


def launcher_module(name: str) -> ModuleType:
    """The module that holds service `name`'s launcher (its `build_parser()` reads a `fleetrl serve` command)."""
    return importlib.import_module(entry_point(name, LAUNCHERS).module)


def config_class(name: str) -> type:
    """Service `name`'s config class (its fields' defaults give the service's ports)."""
    return entry_point(name, CONFIGS).load()
