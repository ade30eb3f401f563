"""CPU seconds each `fleetrl up` service spends before the main job's first step, for one or more checkouts side by
side (issue 40 item 1: launch to the first step).

    python bench/start_cpu.py --trees /tmp/before,/tmp/after --repeats 3 [--cache /tmp]

Each run is bench/vs_trl.py's synchronous main job (the warm-started arithmetic model, P = 16 x G = 8, 5 new
tokens; built once under CACHE/fleetrl-vstrl/init), 2 steps, `fleetrl up` started in the tree (its working
directory and PYTHONPATH, so its services import that tree's code); trees run in turn, `--repeats` rounds. While it
runs, every process under `fleetrl up` is read from /proc every 20 ms; when the first step's line is in
metrics.jsonl, each service's user + system CPU seconds so far are recorded, by role (trainer, inference, gateway,
controller, and `up` itself). Wall time to the first step is given too, but on a shared machine it measures the
load; CPU seconds are what a service's start-up costs whatever else runs (on 2 cores, the services' start-up work
before the first step shares those cores). Medians [min, max] over rounds; --json keeps every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROLES = ("trainer", "inference", "gateway", "controller")


def children(pid: int) -> list[int]:
    """`pid`'s descendants (from /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    words = [a.decode(errors="replace") for a in argv]
    if "serve" in words:
        return words[words.index("serve") + 1]
    return "other"


def first_step_written(metrics: Path) -> bool:
    """Whether metrics.jsonl holds a step's line (a line still being written is not one)."""
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) >= 1:
                return True
        except (ValueError, AttributeError, TypeError):
            continue
    return False


def one_run(tree: Path, config: Path, metrics: Path, timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetrl", "up", str(config), "--overwrite"],
        cwd=tree,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    seen: dict[int, tuple[str, float]] = {}
    deadline = started + timeout_s
    try:
        while time.monotonic() < deadline:
            for pid in children(proc.pid):
                cpu = cpu_seconds(pid)
                if cpu is not None:  # the role read again until the child has exec'd its service
                    known = seen.get(pid, ("other", 0.0))[0]
                    seen[pid] = (known if known != "other" else role(pid), cpu)
            if first_step_written(metrics):
                break
            if proc.poll() is not None:
                raise SystemExit(f"fleetrl up in {tree} exited {proc.returncode} before its first step")
            time.sleep(0.02)  # a sampling period, not a synchronisation
        else:
            raise SystemExit(f"no first step within {timeout_s} s in {tree}")
        first_step_s = time.monotonic() - started
        up_cpu = cpu_seconds(proc.pid) or 0.0
    finally:
        proc.wait(timeout=timeout_s)
    by_role = {r: 0.0 for r in ROLES}
    for name, cpu in seen.values():
        if name in by_role:
            by_role[name] += cpu
    by_role["up"] = up_cpu
    return {"first_step_s": first_step_s, "cpu_s": by_role, "cpu_total_s": sum(by_role.values())}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated checkouts to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default="/tmp", help="folder of the cached warm start (bench/vs_trl.py's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to its first step")
    parser.add_argument("--json", help="write every run here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(BENCH))
    import vs_trl

    cache = Path(args.cache)
    init = vs_trl.warm_start(cache)
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for rep in range(args.repeats):
        for i, tree in enumerate(trees):
            folder = cache / "fleetrl-start-cpu" / f"tree{i}-{rep}"
            folder.mkdir(parents=True, exist_ok=True)
            config = folder / "config.json"
            (folder / "run" / "metrics.jsonl").unlink(missing_ok=True)  # the previous call's: not this run's step
            config.write_text(json.dumps(vs_trl.fleetrl_config(init, folder / "run", "fleetrl_sync", 2, 0.0)))
            load = os.getloadavg()[0]
            result = {**one_run(tree, config, folder / "run" / "metrics.jsonl", args.timeout), "load": load}
            runs[str(tree)].append(result)
            print(f"round {rep} {tree}: {json.dumps(result)}", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    header = ["tree", "wall to first step s", "CPU s, all services", *[f"{r} CPU s" for r in (*ROLES, "up")]]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for tree, results in runs.items():
        cells = [tree, spread([r["first_step_s"] for r in results]), spread([r["cpu_total_s"] for r in results])]
        cells += [spread([r["cpu_s"][k] for r in results]) for k in (*ROLES, "up")]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
