"""Shared test fixtures: free ports, a clean environment and logging per test."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import pytest

from fleetrl.tiny_model import build_tiny_model
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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen2 model + byte-level BPE tokenizer in HF format, built once per session."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "qwen2"))
