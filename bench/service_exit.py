"""Seconds from SIGTERM to process exit of an idle service, with and without the fast exit (issue 19).

    python bench/service_exit.py [--repeats 5] [--kinds trainer,inference]

Each sample starts `fleetrl serve KIND` on a tiny model built under a temporary folder, waits for its ready file,
sends SIGTERM and times the exit. "fast" runs the `fleetrl` entry (`python -m fleetrl`, which skips the
interpreter's teardown when nothing can be lost: fleetrl/commands/fast_exit.py); "ordinary" runs the same `main`
and returns through `sys.exit`, the interpreter tearing down torch, gRPC and ZeroMQ. Arms alternate per repeat;
prints the median [min, max] of each and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORDINARY = "import sys; from fleetrl.commands.main import main; sys.exit(main(sys.argv[1:]))"


def service_argv(kind: str, model: str) -> list[str]:
    if kind == "trainer":
        ports = ["--grpc-port", "0", "--groups-port", "0", "--weights-port", "0"]
        return ["serve", "trainer", "--model", model, "--set", "kl_beta=0", *ports]
    return ["serve", "inference", "--model", model, "--engine", "hf", "--grpc-port", "0", "--http-port", "0"]


def exit_seconds(kind: str, model: str, arm: str, folder: Path) -> float:
    ready = folder / f"{kind}-{arm}.json"
    ready.unlink(missing_ok=True)
    head = ["-m", "fleetrl"] if arm == "fast" else ["-c", ORDINARY]
    argv = [sys.executable, *head, *service_argv(kind, model), "--metrics-port", "0", "--ready-file", str(ready)]
    env = {**os.environ, "FLEETRL_AUTH_TOKEN": "bench", "OMP_NUM_THREADS": "1"}
    with open(folder / f"{kind}-{arm}.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{kind} ({arm}) did not become ready; see {folder / f'{kind}-{arm}.log'}")
        time.sleep(0.05)
    time.sleep(1.0)  # idle, as at the end of a run
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", default="trainer,inference")
    parser.add_argument("--json", default="service_exit.json")
    args = parser.parse_args()
    from fleetrl.tiny_model import build_tiny_model

    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = str(build_tiny_model(folder / "qwen2"))
        for _ in range(args.repeats):
            for kind in args.kinds.split(","):
                for arm in ("ordinary", "fast"):
                    results.setdefault(kind, {}).setdefault(arm, []).append(exit_seconds(kind, model, arm, folder))
    Path(args.json).write_text(json.dumps(results, indent=2))
    print("| service | ordinary exit s | fast exit s |\n| --- | --- | --- |")
    for kind, arms in results.items():
        cells = [f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]" for v in (arms["ordinary"], arms["fast"])]
        print(f"| {kind} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
