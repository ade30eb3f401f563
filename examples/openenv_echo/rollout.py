"""The rollout of examples/openenv_echo: start the OpenEnv server of server.py on this process's loopback (once per
gateway, in a thread), then play each row's episode against it with fleetrl's OpenEnv adapter, openenv-core's own
client on one side and the policy behind an agent session on the other.

    fleetrl up examples/openenv_echo/run.toml

An environment server that runs elsewhere needs no file of its own: `[up] rollout =
"fleetrl.environments:make_rollout_fn"` with `rollout_extras.environment = "openenv:http://HOST:PORT"`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from server import make_app  # this example's environment server, beside this file

from fleetrl import RolloutSetup
from fleetrl.environments.openenv import OpenEnvRollout

_server_url: str | None = None
_lock = threading.Lock()


def start_server(timeout_s: float = 60.0) -> str:
    """Serve `make_app()` on a free loopback port in a daemon thread (ends with the process); returns its URL."""
    global _server_url
    with _lock:
        if _server_url is None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            server = uvicorn.Server(uvicorn.Config(make_app(), log_level="warning"))
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="openenv").start()
            deadline = time.monotonic() + timeout_s
            while not server.started:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OpenEnv server did not start within {timeout_s} s")
                time.sleep(0.05)  # polling the server's own flag, with a deadline
            _server_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return _server_url


def make_rollout_fn(setup: RolloutSetup) -> Any:
    return OpenEnvRollout(setup, start_server(), setup.extras.get("environment_options"))
