"""A stand-in service for the preload tests, run as `python -m tests.integration.up.preload_target OUT ACTION [ARG]`:
it writes what it sees (argv, cwd, environment, sys.path, session, command line) to OUT as JSON, prints a line, then
exits with ARG (`exit`), raises (`raise`), or waits up to 60 s for SIGTERM and records it (`wait`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path


def seen() -> dict:
    return {
        "name": __name__,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "path": sys.path,
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "pgid": os.getpgid(0),
        "cmdline": [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a],
        "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
    }


def main() -> None:
    out, action = Path(sys.argv[1]), sys.argv[2]
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(seen()))
    os.replace(tmp, out)
    print(f"preload target {action}", flush=True)
    if action == "exit":
        sys.exit(int(sys.argv[3]))
    if action == "raise":
        raise RuntimeError("the target raised")
    if action == "wait":
        if terminated.wait(60):
            out.with_name(out.name + ".terminated").write_text("SIGTERM")
        sys.exit(0)
    raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
