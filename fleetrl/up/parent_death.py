"""A child of `fleetrl up` that dies with its parent, whichever way it was started (a new process or a fork of the
preload server)."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG). Elsewhere
    a no-op: children are still stopped by the supervisor on any normal exit."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
