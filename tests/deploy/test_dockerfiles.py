"""docker/Dockerfile.{cpu,gpu}, read by Docker's own parser (the `dockerfile` package wraps BuildKit's): two
stages, the project's install script in the build stage, a runtime stage with no compiler running as a
non-root user, a HEALTHCHECK through the gRPC health probe, and a build context that carries what the install
needs. No engine runs here; CI's run of scripts/install.sh covers the install steps themselves."""

from __future__ import annotations

import fnmatch
import json

import pytest

from tests.deploy.localstack import REPO

dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` parser is not installed (pip)")

BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "clang", "cmake", "git")
TARGETS = ("cpu", "gpu")


def stages(target: str) -> list[list]:
    commands = dockerfile.parse_file(str(REPO / "docker" / f"Dockerfile.{target}"))
    out: list[list] = []
    for command in commands:
        if command.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(command)
    return out


def runs(stage: list) -> str:
    return "\n".join(" ".join(c.value) for c in stage if c.cmd == "RUN")


@pytest.mark.parametrize("target", TARGETS)
def test_multi_stage_with_the_project_install_in_the_build_stage(target):
    build, runtime = stages(target)
    assert build[0].value[-2:] == ("AS", "build") and runtime[0].value[-2:] == ("AS", "runtime")
    assert "bash scripts/install.sh" in runs(build)
    env = " ".join(" ".join(c.value) for c in build if c.cmd == "ENV")
    assert ("FLEETRL_GPU 1" in env) == (target == "gpu")
    copies = [c.value for c in runtime if c.cmd == "COPY"]
    assert any("--from=build" in c.flags for c in runtime if c.cmd == "COPY")
    assert {c[-1] for c in copies} >= {"/opt/venv", "/opt/fleetrl"}


@pytest.mark.parametrize("target", TARGETS)
def test_runtime_stage_has_no_build_tools_and_a_non_root_user(target):
    _, runtime = stages(target)
    installed = runs(runtime)
    for tool in BUILD_TOOLS:
        assert f" {tool} " not in f" {installed} ", tool
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert f"useradd --create-home --uid 10001 --user-group {users[-1]}" in installed
    assert f"chown {users[-1]}:{users[-1]} /var/lib/fleetrl" in installed  # volumes initialise writable


@pytest.mark.parametrize("target", TARGETS)
def test_healthcheck_entrypoint_and_ports(target):
    _, runtime = stages(target)
    (health,) = [c for c in runtime if c.cmd == "HEALTHCHECK"]
    assert health.value == ("CMD", "python", "-m", "fleetrl.commands.health", "--auto")
    (entry,) = [c for c in runtime if c.cmd == "ENTRYPOINT"]
    assert entry.json and list(entry.value) == ["tini", "--", "fleetrl"]
    exposed = {int(p) for c in runtime if c.cmd == "EXPOSE" for p in c.value}
    assert exposed == {50050, 50051, 50061, 50071, 5571, 5572, 8000, 9400, 9401, 9402, 9403, 9404}


@pytest.mark.parametrize("target", TARGETS)
def test_build_context_keeps_what_the_install_needs(target):
    patterns = [
        line.strip()
        for line in (REPO / "docker" / f"Dockerfile.{target}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    needed = ["pyproject.toml", "setup.py", "README.md", "constraints-cpu.txt", "scripts/install.sh"]
    needed += ["fleetrl/__init__.py", "fleetrl/commands/health.py", "services/controller/launcher.py"]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not any(fnmatch.fnmatch(path, p) or path.split("/")[0] == p for p in patterns), path
    for secret in (".env", ".git"):
        assert secret in patterns


def test_both_images_differ_only_where_the_hardware_does():
    cpu, gpu = (stages(t) for t in TARGETS)
    assert [c.cmd for c in cpu[1]] == [c.cmd for c in gpu[1]]
    assert json.dumps([c.value for c in cpu[1] if c.cmd != "ENV"]) == json.dumps(
        [c.value for c in gpu[1] if c.cmd != "ENV"]
    )
