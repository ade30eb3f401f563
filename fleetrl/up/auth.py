"""The shared token of a `fleetrl up` run: every service requires it (gRPC `authorization: Bearer`, ZeroMQ streams).

Auth is on by default: without `[up] auth_token` or `$FLEETRL_AUTH_TOKEN`, `fleetrl up` generates a random token
per run, hands it to its children through the environment, and writes it to `<log_path>/auth_token` (mode 0600),
where `fleetrl status --run LOG_PATH` and attaching tools find it. Any other local process is refused.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE = "auth_token"


def run_auth_token(configured: str | None, log_dir: Path, attach: bool = False) -> str | None:
    """The token the run's services share: the configured one, $FLEETRL_AUTH_TOKEN, else a new random one (saved
    in `log_dir`). Gateways attaching to a running controller (`attach`) reuse the run's saved token, if any."""
    token = configured or os.environ.get("FLEETRL_AUTH_TOKEN")
    if token:
        return token
    path = log_dir / TOKEN_FILE
    if attach:
        return read_run_token(log_dir)
    token = secrets.token_urlsafe(32)
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


def read_run_token(log_dir: Path) -> str | None:
    """The token a run saved in its log folder, or None."""
    try:
        return (log_dir / TOKEN_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None
