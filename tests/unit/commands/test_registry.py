"""The services found through package entry points (fleetrl/commands/registry.py): the installed ones, a name with no
entry point, a stale distribution that would hide them, and `fleetrl serve` starting whatever an entry point names."""

from __future__ import annotations

from importlib.metadata import EntryPoint, EntryPoints

import pytest

from fleetrl.commands import registry
from fleetrl.commands.main import SERVICES, main
from fleetrl.commands.registry import (
    CONFIGS,
    LAUNCHERS,
    UnknownServiceError,
    config_class,
    entry_point,
    launcher_main,
    launcher_module,
    service_names,
)


class FakeDistribution:
    def __init__(self, *points: EntryPoint) -> None:
        self.entry_points = EntryPoints(points)


def fake_launcher(argv: list[str]) -> int:
    return 7 if argv == ["--flag", "x"] else 1


def use_distributions(monkeypatch: pytest.MonkeyPatch, *dists: FakeDistribution) -> None:
    monkeypatch.setattr(registry, "distributions", lambda: iter(dists))


def test_every_service_is_installed_with_a_launcher_and_a_config():
    assert set(service_names(LAUNCHERS)) == set(SERVICES) == set(service_names(CONFIGS))
    for name in SERVICES:
        assert callable(launcher_main(name))
        assert callable(launcher_module(name).build_parser)
        assert {"host", "metrics_port"} <= set(config_class(name).model_fields), name


def test_an_unknown_name_lists_the_known_ones(capsys):
    with pytest.raises(UnknownServiceError, match=r"unknown service 'trainr'; choose one of controller, gateway, "):
        entry_point("trainr")
    assert main(["serve", "trainr"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetrl serve: unknown service 'trainr'; choose one of ") and "inference" in err


def test_no_entry_points_says_to_install_the_package(monkeypatch, capsys):
    use_distributions(monkeypatch, FakeDistribution())
    with pytest.raises(UnknownServiceError, match=r"no services are installed .*fleetrl.service_configs.*pip install"):
        config_class("controller")
    assert main(["serve", "--help"]) == 0
    assert "(none installed" in capsys.readouterr().out


def test_a_stale_distribution_first_does_not_hide_the_installed_entry_points(monkeypatch):
    stale = FakeDistribution(EntryPoint("fleetrl", "fleetrl.cli:main", "console_scripts"))
    point = EntryPoint("echo", f"{__name__}:fake_launcher", LAUNCHERS)
    use_distributions(monkeypatch, stale, FakeDistribution(point))
    assert service_names() == ["echo"] and service_names(CONFIGS) == []
    assert launcher_main("echo") is fake_launcher


def test_serve_starts_what_the_entry_point_names(monkeypatch, capsys):
    use_distributions(monkeypatch, FakeDistribution(EntryPoint("echo", f"{__name__}:fake_launcher", LAUNCHERS)))
    assert main(["serve", "echo", "--flag", "x"]) == 7
    assert main(["serve", "--help"]) == 0
    assert "  echo" in capsys.readouterr().out  # a service with no help line of its own is still listed
