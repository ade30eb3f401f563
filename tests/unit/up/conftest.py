"""The supervisor's unit tests fake `subprocess.Popen`: the preload server that a session with slow tests starts
(tests/conftest.py) must not take their children, so they run without FLEETRL_PRELOAD_SOCKET."""

from __future__ import annotations

import pytest

from fleetrl.up.preload import SOCKET_ENV


@pytest.fixture(autouse=True)
def _ordinary_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
