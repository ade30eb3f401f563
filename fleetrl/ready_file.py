"""Ready files: how a service started on port 0 tells its launcher where it listens.

    write_ready_file(path, {"grpc_port": 50123, "groups_address": "tcp://127.0.0.1:41234"})   # service
    info = wait_ready_file(path, timeout_s=60, process=proc)                                 # launcher

The file is written atomically (rename), once every endpoint is bound and serving, so a reader never sees
a partial JSON document.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def write_ready_file(path: str | Path, info: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, path)


def wait_ready_file(path: str | Path, timeout_s: float, process: Any = None) -> dict[str, Any]:
    """The ready file's content once it exists; raises TimeoutError, or RuntimeError if `process` exits."""
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before writing {path}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout_s}s")
