"""A long soak at real concurrency: the OpenAI-agent example (every sample an agent session over HTTP) under
`fleetrl up` with two gateways and two replicas, O = 1 with overlapped pushes, and a replica SIGKILLed every
`--restart-every` steps (fleetrl up restarts it; it rejoins and catches up). Every few seconds each service's RSS, open
file descriptors and threads are read from /proc; at the end the first and last stretches are compared and a plot is
written.

Command (from the repository root; `--minutes 30` is the issue's soak, a few minutes checks the script):

    python bench/soak.py [--minutes 30] [--restart-every 200] [--sample-every 10] [--out runs/soak]

Writes OUT/samples.csv (time, step, service, pid, rss_mb, fds, threads), OUT/summary.json and OUT/soak.png. "Flat"
is read per service from the medians of the first and last fifth of the run after a warm-up of the first fifth
(so the first stretch is the second fifth): the change in RSS (MB), descriptors and threads, and the least-squares
slope of RSS per hour over the last four fifths. The run's own record is checked as well: every step once in
metrics.jsonl, and the number of replica restarts seen.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "openai_agent"
SERVE = re.compile(r"fleetrl serve (\w+) ")
READY = re.compile(r" --ready-file \S*/ready/([\w.-]+)\.json")


@dataclass(frozen=True)
class Probe:
    """One service process at one moment."""

    t_s: float
    step: int
    service: str  # controller, trainer, inference-0, gateway-1, ...
    pid: int
    rss_mb: float
    fds: int
    threads: int


def service_processes(log_dir: Path) -> dict[str, int]:
    """{service name: pid} of the `fleetrl serve` processes of the run whose log_path is `log_dir`: the ready-file
    name where a service has its own (controller, trainer, inference-0, ...), else its kind and rank by pid
    (gateway-0, gateway-1)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    found: dict[str, int] = {}
    unnamed: dict[str, list[int]] = defaultdict(list)
    for line in out.splitlines():
        pid_text, _, args = line.strip().partition(" ")
        kind = SERVE.search(args)
        if kind is None or f"{log_dir}/" not in args:
            continue
        ready = READY.search(args)
        if ready is not None:
            found[ready.group(1)] = int(pid_text)
        else:
            unnamed[kind.group(1)].append(int(pid_text))
    for kind, pids in unnamed.items():
        found.update({f"{kind}-{i}": pid for i, pid in enumerate(sorted(pids))})
    return found


def probe(pid: int) -> tuple[float, int, int] | None:
    """(RSS in MB, open descriptors, threads) of `pid`, or None if it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return rss_kb / 1024, fds, int(fields["Threads"])


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            continue  # a line being written
    return steps


def write_config(out: Path, model: Path, args: argparse.Namespace) -> Path:
    run = {
        "base_model": str(model),
        "dataset": str(EXAMPLE / "problems.jsonl"),
        "log_path": str(out / "run"),
        "max_steps": 1_000_000,  # the soak stops by time
        "epochs": 1_000_000,
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 12,
        "max_seq_len": 1024,
        "learning_rate": 1e-5,
        "kl_beta": 0.0,
        "max_head_offpolicy_versions": 1,
        "overlap_weight_push": True,
        "dcp_save_interval": args.checkpoint_every,
        "rollout_extras": {"max_turns": 3},
    }
    up = {
        "rollout": str(EXAMPLE / "rollout.py") + ":make_rollout_fn",
        "engine": "hf",
        "gateways": 2,
        "replicas": 2,
        "max_replica_restarts": 1_000,
        "startup_timeout_s": 600,
    }
    path = out / "soak.json"
    path.write_text(json.dumps({"run": run, "up": up}, indent=1))
    return path


def summarise(probes: list[Probe], total_s: float) -> dict[str, dict[str, float]]:
    by_service: dict[str, list[Probe]] = defaultdict(list)
    for p in probes:
        by_service[p.service].append(p)
    fifth = total_s / 5
    summary = {}
    for service, rows in sorted(by_service.items()):
        early = [p for p in rows if fifth <= p.t_s < 2 * fifth]
        late = [p for p in rows if p.t_s >= 4 * fifth]
        tail = [p for p in rows if p.t_s >= fifth]
        if not early or not late or len(tail) < 3:
            continue

        def med(ps: list[Probe], attr: str) -> float:
            return statistics.median(getattr(p, attr) for p in ps)

        xs = [p.t_s / 3600 for p in tail]
        ys = [p.rss_mb for p in tail]
        slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
        summary[service] = {
            "rss_mb_early": round(med(early, "rss_mb"), 1),
            "rss_mb_late": round(med(late, "rss_mb"), 1),
            "rss_mb_per_hour": round(slope, 1),
            "fds_early": med(early, "fds"),
            "fds_late": med(late, "fds"),
            "threads_early": med(early, "threads"),
            "threads_late": med(late, "threads"),
            "pids": len({p.pid for p in rows}),
        }
    return summary


def plot(probes: list[Probe], restarts: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    by_service: dict[str, list[Probe]] = defaultdict(list)
    for p in probes:
        by_service[p.service].append(p)
    for service, rows in sorted(by_service.items()):
        t = [p.t_s / 60 for p in rows]
        axes[0].plot(t, [p.rss_mb for p in rows], label=service, lw=1)
        axes[1].plot(t, [p.fds for p in rows], lw=1)
        axes[2].plot(t, [p.threads for p in rows], lw=1)
    for ax, label in zip(axes, ["RSS (MB)", "open descriptors", "threads"], strict=True):
        ax.set_ylabel(label)
        for r in restarts:
            ax.axvline(r / 60, color="grey", lw=0.5, ls=":")
    axes[0].legend(fontsize=7, ncol=3)
    axes[2].set_xlabel("minutes (dotted: a replica SIGKILLed)")
    fig.suptitle("bench/soak.py: every service's RSS, descriptors and threads")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--restart-every", type=int, default=200, help="SIGKILL a replica every N steps (0: never)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between /proc reads")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: a tiny one built here)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "soak")
    args = parser.parse_args()

    out = args.out.resolve()
    if (out / "run").exists():
        raise SystemExit(f"{out / 'run'} exists: give another --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = out / "tiny_model"
        if not model.exists():
            subprocess.run([sys.executable, "-m", "fleetrl.tiny_model", str(model)], check=True, cwd=REPO)
    config = write_config(out, model.resolve(), args)
    run_dir = out / "run"
    with open(out / "fleetrl_up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetrl", "up", str(config)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        probes: list[Probe] = []
        restarts: list[float] = []
        start = time.monotonic()
        deadline = start + args.minutes * 60
        next_restart = args.restart_every
        victim = 0
        first_step_s: float | None = None
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    print(f"fleetrl up exited early with {proc.returncode}; see {out / 'fleetrl_up.log'}")
                    break
                steps = steps_done(run_dir)
                step = max(steps, default=0)
                now = time.monotonic() - start
                if step and first_step_s is None:
                    first_step_s = now
                for service, pid in service_processes(run_dir).items():
                    read = probe(pid)
                    if read is not None:
                        probes.append(Probe(round(now, 1), step, service, pid, *read))
                if args.restart_every and step >= next_restart:
                    replicas = {s: p for s, p in service_processes(run_dir).items() if s.startswith("inference")}
                    name = sorted(replicas)[victim % len(replicas)] if replicas else None
                    if name is not None:
                        os.kill(replicas[name], signal.SIGKILL)
                        restarts.append(now)
                        print(f"[{now:7.0f} s] step {step}: SIGKILL {name} (pid {replicas[name]})", flush=True)
                        victim += 1
                    next_restart += args.restart_every
                if len(probes) and int(now) % 60 < args.sample_every:
                    print(f"[{now:7.0f} s] step {step}, {len(probes)} probes", flush=True)
                time.sleep(args.sample_every)  # a sampling period, not a synchronisation
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # a graceful stop, as Ctrl-C
                try:
                    proc.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    total_s = time.monotonic() - start
    steps = steps_done(run_dir)
    with open(out / "samples.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "step", "service", "pid", "rss_mb", "fds", "threads"])
        for p in probes:
            writer.writerow([p.t_s, p.step, p.service, p.pid, round(p.rss_mb, 1), p.fds, p.threads])
    summary = {
        "minutes": round(total_s / 60, 1),
        "steps": len(steps),
        "steps_unique_and_consecutive": steps == list(range(1, len(steps) + 1)),
        "first_step_s": first_step_s,
        "replica_kills": len(restarts),
        "exit_code": proc.returncode,
        "services": summarise(probes, total_s),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if probes:
        plot(probes, restarts, out / "soak.png")
    print(json.dumps(summary, indent=1))
    print(f"samples: {out / 'samples.csv'}  plot: {out / 'soak.png'}")
    return 0 if summary["steps"] and summary["steps_unique_and_consecutive"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
