"""`fleetrl up` of the tiny model, its services started as new processes vs forked from a preload server
(fleetrl/up/preload.py), interleaved: fresh, preload, fresh, preload, ...

    python bench/up_start.py --repeats 5

Each run is the test suite's default `fleetrl up` (3 steps, one hf replica, one gateway, the controller and the
trainer). Reported per arm, as medians: the wall time of `fleetrl up` and the time until its first step is in
metrics.jsonl (nearly all of it is starting the services). The preload server is started once, before the first
run, and its own start (importing torch, transformers and datasets) is reported apart: it is paid once per machine,
not per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetrl.tiny_model import build_tiny_model  # noqa: E402
from fleetrl.up.preload import SOCKET_ENV  # noqa: E402


def write_run(folder: Path, model: Path) -> Path:
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"count {i} to {i + 3}:"}) + "\n" for i in range(24)))
    run = {
        "base_model": str(model),
        "dataset": str(rows),
        "log_path": str(folder / "run"),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "learning_rate": 1e-3,
        "max_steps": 3,
        "seed": 0,
    }
    up = {"rollout": "tests.integration.up.rollouts:make_rollout_fn", "engine": "hf", "startup_timeout_s": 240}
    config = folder / "run.json"
    config.write_text(json.dumps({"run": run, "up": up}))
    return config


def one_run(folder: Path, model: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall s, s to the first step) of one `fleetrl up`."""
    config = write_run(folder, model)
    metrics = folder / "run" / "metrics.jsonl"
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetrl", "up", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = None
    deadline = start + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.monotonic() - start
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"fleetrl up failed ({proc.returncode}): {err[-2000:]}")
    return wall, first if first is not None else wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        socket_path = root / "preload.sock"
        server_start = time.monotonic()
        server = subprocess.Popen(
            [sys.executable, "-m", "fleetrl.up.preload", "--socket", str(socket_path)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        try:
            while not socket_path.exists():
                if server.poll() is not None or time.monotonic() - server_start > 300:
                    raise SystemExit("the preload server did not start")
                time.sleep(0.05)
            server_s = time.monotonic() - server_start
            fresh_env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
            arms = {"new processes": fresh_env, "preload server": {**fresh_env, SOCKET_ENV: str(socket_path)}}
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
            for i in range(args.repeats):
                for name, env in arms.items():
                    folder = root / f"{name.replace(' ', '_')}_{i}"
                    folder.mkdir()
                    results[name].append(one_run(folder, model, env))
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"preload server start (once): {server_s:.1f} s")
    print(f"| services started as | fleetrl up wall (median of {args.repeats}) | to the first step | runs |")
    print("| --- | --- | --- | --- |")
    for name, rows in results.items():
        walls = [w for w, _ in rows]
        firsts = [f for _, f in rows]
        print(
            f"| {name} | {statistics.median(walls):.1f} s | {statistics.median(firsts):.1f} s | "
            f"{', '.join(f'{w:.1f}' for w in walls)} |"
        )


if __name__ == "__main__":
    main()
