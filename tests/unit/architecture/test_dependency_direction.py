"""The dependency direction, checked by import analysis of the source: services -> library only.

- nothing under fleetrl/ imports fleetrl.services (statically, inside a function, or by a module name string given
  to importlib);
- a service imports no other service (services/<a> never names fleetrl.services.<b>).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVICES = "fleetrl.services"


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import statement and every string literal that names a fleetrl module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(SERVICES):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):  # f"fleetrl.services.{name}.launcher"
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and str(head.value).startswith(SERVICES):
                found.append((node.lineno, str(head.value)))
    return found


def library_files() -> list[Path]:
    return [p for p in (ROOT / "fleetrl").rglob("*.py") if "v1" not in p.relative_to(ROOT / "fleetrl").parts[:1]]


def test_the_checker_sees_imports_of_every_kind(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import fleetrl.services.a\n"
        "from fleetrl.services.b import x\n"
        "def f():\n    from fleetrl.services import c\n"
        "import importlib\nimportlib.import_module(f'fleetrl.services.{n}.launcher')\n"
        "importlib.import_module('fleetrl.services.d.config')\n"
    )
    names = [name for _, name in imported_names(source) if name.startswith(SERVICES)]
    assert "fleetrl.services.a" in names and "fleetrl.services.b" in names and "fleetrl.services.c" in names
    assert "fleetrl.services." in names and "fleetrl.services.d.config" in names


def test_the_library_never_imports_a_service() -> None:
    files = library_files()
    assert len(files) > 50, "the library's files were not found"
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for line, name in imported_names(path)
        if name == SERVICES or name.startswith(SERVICES + ".")
    ]
    assert not offenders, "the library must not import services:\n" + "\n".join(offenders)


def test_no_service_imports_another() -> None:
    services = [p for p in (ROOT / "services").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert {p.name for p in services} >= {"controller", "gateway", "inference", "reference", "trainer"}
    offenders = []
    for service in services:
        own = f"{SERVICES}.{service.name}"
        for path in service.rglob("*.py"):
            for line, name in imported_names(path):
                if name.startswith(SERVICES) and not (name == own or name.startswith(own + ".")):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not offenders, "a service must import only the library and itself:\n" + "\n".join(offenders)


def test_every_service_has_the_same_shape() -> None:
    """launcher.py (parse, one call) and server.py (wiring) everywhere; servicer.py wherever the service answers a
    gRPC API of its own (the gateway answers none: it is a client of the controller and the inference replicas)."""
    for service in ("controller", "inference", "reference", "trainer", "gateway"):
        folder = ROOT / "services" / service
        files = {p.name for p in folder.glob("*.py")}
        expected = {"launcher.py", "server.py"} | ({"servicer.py"} if service != "gateway" else set())
        assert expected <= files, f"services/{service} lacks {sorted(expected - files)}"
