"""Shared test fixtures: free ports, a clean environment and logging per test."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetrl.tiny_model import build_tiny_model
from fleetrl.up.cpu_threads import reproducible_math_env
from fleetrl.up.preload import SOCKET_ENV
from tests.lanes import pytest_collection_finish, pytest_deselected  # noqa: F401  (CI's lane check, .ci/run)
from tests.skip_policy import (  # noqa: F401  (pytest finds hooks by name: the expected skips, FLEETRL_STRICT_SKIPS)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)
from tests.waiting import wait_until
from tests.workers import (  # noqa: F401  (the lanes' workers take whole modules, the longest first)
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)

# `fleetrl up` gives its services oneMKL's reproducibility variables where the user's environment lacks them
# (fleetrl/up/cpu_threads.py). The session sets them itself, so the preload server (started with the session's
# environment) and the services it forks see what a fresh start would, and none has to start fresh for them.
os.environ.update(reproducible_math_env(os.environ))


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (prefer binding port 0 where possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def _clean_env_and_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without fleetrl's auth token set and with default log levels."""
    monkeypatch.delenv("FLEETRL_AUTH_TOKEN", raising=False)
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)
    for key in [k for k in os.environ if k.startswith("FLEETRL_TEST_")]:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module", autouse=True)
def _restore_environment(_session_environment: dict[str, str]) -> Iterator[None]:
    """Each test module ends with the process environment back as the session began. Libraries loaded in-process
    set variables while importing or starting (vLLM sets TORCHINDUCTOR_*, PYTORCH_NVML_BASED_CUDA_CHECK,
    LD_LIBRARY_PATH...), some in fixtures shared by a package of modules: left in place they would reach every
    later test's `fleetrl up` and its services, which would then see an environment no user's shell has (and could
    not be forked from the preload server, whose environment is the session's)."""
    yield
    if dict(os.environ) != _session_environment:
        os.environ.clear()
        os.environ.update(_session_environment)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 model + byte-level BPE tokenizer in HF format, built once per session."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "qwen2"))


@pytest.fixture(scope="session", autouse=True)
def _session_environment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """A session that runs slow tests forks the services of its `fleetrl up` runs from one preload server
    (fleetrl/up/preload.py): torch and transformers are imported once, not in every service of every run.
    FLEETRL_TEST_NO_PRELOAD=1 starts every service as a new process instead (the ordinary start, which
    tests/integration/up/test_preload.py and the runs that set their own environment still exercise). Its value
    is the session's environment, which `_restore_environment` brings back after each module."""
    wanted = any(item.get_closest_marker("slow") for item in request.session.items)
    if not wanted or os.environ.get("FLEETRL_TEST_NO_PRELOAD") or os.environ.get(SOCKET_ENV):
        yield dict(os.environ)
        return
    socket_path = tmp_path_factory.mktemp("preload") / "preload.sock"
    log = open(socket_path.with_name("preload.log"), "ab")  # noqa: SIM115 - the server's output, for a failure
    server = subprocess.Popen(
        [sys.executable, "-m", "fleetrl.up.preload", "--socket", str(socket_path)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: socket_path.exists() or server.poll() is not None, 300, "the preload server")
        if server.poll() is not None:
            raise RuntimeError(f"the preload server exited: {socket_path.with_name('preload.log').read_text()}")
        os.environ[SOCKET_ENV] = str(socket_path)
        yield dict(os.environ)
    finally:
        os.environ.pop(SOCKET_ENV, None)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()
