"""Fixtures of the trainer integration tests: services started as real processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleetrl.ready_file import wait_ready_file


@contextmanager
def service_process(args: list[str], workdir: Path, name: str, timeout_s: float = 90.0) -> Iterator[dict[str, Any]]:
    """Run `fleetrl serve <args> --ready-file ...`; yield the ready file's content; stop it (SIGTERM).

    The process log goes to workdir/<name>.log and is printed if the service fails to come up.
    """
    ready = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetrl", "serve", *args, "--ready-file", str(ready)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            try:
                info = wait_ready_file(ready, timeout_s, process=proc)
            except (TimeoutError, RuntimeError) as exc:
                raise RuntimeError(f"{name} did not start: {exc}\n{log_path.read_text()[-4000:]}") from exc
            info["log_path"] = str(log_path)
            info["process"] = proc
            yield info
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
