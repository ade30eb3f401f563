"""The speed guard: the CPU figures that past work won, each a ratio to its own baseline measured in the same run.

    python bench/guard.py                 # about 3-5 min on 2 cores; prints the table beside the last recorded one
    python bench/guard.py --record        # the same, then writes the table into docs/benchmarks.md as the new record

Run it before a change lands whenever the change touches the trainer, the weight path, an engine or start-up, and
put its table in the closing note. It is a benchmark, not a test: nothing here is asserted by the suite (the suite
only dry-runs it with tiny sizes, tests/unit/bench/test_guard.py). The figures, each a ratio (lower is better):

- `trainer_step`: the trainer's step (perf/train_time of a synchronous `fleetrl up` run: the TrainStep call) over a
  bare PyTorch step of the same model on the same 128 samples (forward, backward, AdamW: bench/vs_trl_limit.py);
- `up_sync_step`, `up_o1_step`: `fleetrl up` s/step (median interval between step ends), synchronous and O = 1, over
  the bare loop's step (bare generate + the bare train step);
- `up_first_step`: launch to the end of the first step, `fleetrl up` O = 1 over the bare loop's (its process start,
  imports, model load, first generate and train step);
- `version_to_replica`: a 0.45 GB float32 version (a 113M-parameter Qwen2-shaped model) from `publish` to one hf
  replica serving it (`load_weights` returned), over the same bytes sent over raw ZeroMQ loopback (PUSH to a PULL
  that keeps every frame, one process each).

The workload is the main job's (examples/arithmetic: P = 16 prompts x G = 8, 5 new tokens, lr 3e-4, T = 1), on a
model from a short warm start (`--warm-steps`, cached under `--cache`; the speed does not depend on how well it
adds). Arms run interleaved, `--repeats` times (bare, sync, O = 1, weights; then again), one process each; a figure
is the median over repeats of each repeat's ratio, with [min, max]. docs/benchmarks.md, section "Speed guard",
holds the record: the guard flags a figure whose median is worse than the newest recorded median by more than the
spread (max - min) over the two newest records (at least 5 % of the median), and exits 1 if any is flagged. Run it on
a quiet machine: the ratios are not load-free (with the test suite running beside it every figure came out 1.2x to
2.4x its quiet record), so it warns when the load average is above BUSY_LOAD before it starts, and the header
records the load.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "## Speed guard (`bench/guard.py`)"
TIMEOUT_S = 600.0
# A 1-minute load average above this before the run means other work shares the CPUs: the ratios are not load-free
# (fleetrl up's processes lose more to a busy machine than the one-process baseline does; docs/benchmarks.md).
BUSY_LOAD = 1.0

FIGURES = {
    "trainer_step": "trainer step / bare fwd+bwd+AdamW step (same model, same 128 samples)",
    "up_sync_step": "`fleetrl up` sync s/step / bare generate+train step",
    "up_o1_step": "`fleetrl up` O = 1 s/step / bare generate+train step",
    "up_first_step": "`fleetrl up` O = 1 launch to first step / bare loop's",
    "version_to_replica": "0.45 GB fp32 version, publish to served by one hf replica / raw ZeroMQ loopback",
}


def _vs_trl() -> Any:
    sys.path.insert(0, str(BENCH))
    import vs_trl

    return vs_trl


def warm_start(cache: Path, steps: int) -> Path:
    """The arithmetic example's model after `steps` supervised steps, and its rows; built once under `cache`."""
    init = cache / f"init-{steps}"
    if not (init / "done").exists():
        cmd = [sys.executable, str(REPO / "examples" / "arithmetic" / "warm_start.py"), "--out", str(init)]
        subprocess.run([*cmd, "--steps", str(steps)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        (init / "done").write_text("")
    return init


# --- the weight path --------------------------------------------------------------------------------------------


def _zmq_sink(address: str, frames: int, results: Any) -> None:
    """A PULL that keeps every frame it receives (as any receiver that holds the weights must), then reports."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(address)
    results.put(("ready", 0.0))
    kept = [sock.recv(copy=False) for _ in range(frames)]
    results.put(("received", time.monotonic()))
    del kept
    sock.close(0)
    ctx.term()


def raw_zmq_seconds(payload: Any, chunk: int = 64 << 20) -> float:
    """Seconds to send `payload` (a contiguous CPU tensor's bytes) over ZeroMQ loopback to another process."""
    import zmq

    view = memoryview(payload.numpy()).cast("B")
    frames = [view[i : i + chunk] for i in range(0, len(view), chunk)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    results = mp.get_context("spawn").Queue()
    sink = mp.get_context("spawn").Process(target=_zmq_sink, args=(f"tcp://127.0.0.1:{port}", len(frames), results))
    sink.start()
    try:
        assert results.get(timeout=TIMEOUT_S)[0] == "ready"
        started = time.monotonic()
        for frame in frames:
            sock.send(frame, copy=False)
        kind, ended = results.get(timeout=TIMEOUT_S)
        assert kind == "received"
        return ended - started
    finally:
        sink.join(TIMEOUT_S)
        sock.close(0)
        ctx.term()


def _replica_serves() -> Any:
    sys.path.insert(0, str(BENCH))
    import replica_serves

    return replica_serves


def measure_version(cache: Path, size: str) -> dict[str, float]:
    """One float32 version from `publish` to served by one hf replica (bench/replica_serves.py's `measure`; the first
    version warms the reused buffers and is not counted), and the same bytes over raw ZeroMQ loopback."""
    import torch
    from safetensors.torch import load_file

    replica_serves = _replica_serves()
    path = replica_serves.build_model(cache, size)
    served = replica_serves.measure(path, 1, 1, dtype="float32", modes=("zmq",), warmup=1)
    tensors = [t for f in sorted(path.glob("*.safetensors")) for t in load_file(f).values()]
    flat = torch.cat([t.float().reshape(-1).view(torch.uint8) for t in tensors])
    return {"bytes": float(flat.numel()), "serves_s": served["zmq_serves_s"], "raw_zmq_s": raw_zmq_seconds(flat)}


# --- the runs ---------------------------------------------------------------------------------------------------


def one_repeat(
    init: Path, work: Path, cache: Path, version_size: str, steps: int, rep: int
) -> dict[str, dict[str, float]]:
    """One round of every arm, in order: bare loop, sync, O = 1, the weight path."""
    vs_trl = _vs_trl()
    out: dict[str, dict[str, float]] = {}
    for arm in ("limit_t1", "fleetrl_sync", "fleetrl_o1"):
        result = vs_trl.run_arm(arm, init, work / f"{arm}-{rep}", steps, 0.0)
        out[arm] = {
            "step_s": result["step_s_median"],
            "first_step_s": result["start_to_first_step_s"],
            "train_s": result.get("train_s", result.get("perf", {}).get("perf/train_time", float("nan"))),
        }
        print(f"guard: repeat {rep} {arm}: {out[arm]}", file=sys.stderr, flush=True)
    out["version"] = measure_version(cache, version_size)
    print(f"guard: repeat {rep} version: {out['version']}", file=sys.stderr, flush=True)
    return out


def ratios(run: dict[str, dict[str, float]]) -> dict[str, float]:
    bare, sync, o1, version = run["limit_t1"], run["fleetrl_sync"], run["fleetrl_o1"], run["version"]
    return {
        "trainer_step": sync["train_s"] / bare["train_s"],
        "up_sync_step": sync["step_s"] / bare["step_s"],
        "up_o1_step": o1["step_s"] / bare["step_s"],
        "up_first_step": o1["first_step_s"] / bare["first_step_s"],
        "version_to_replica": version["serves_s"] / version["raw_zmq_s"],
    }


# --- the record in docs/benchmarks.md ---------------------------------------------------------------------------

_ROW = re.compile(r"^\| `(\w+)` \| [^|]* \| ([\d.]+) \[([\d.]+), ([\d.]+)\] \|")


def recorded(doc: Path = DOC, tables: int = 2) -> dict[str, tuple[float, float, float]]:
    """The record the guard compares with: {figure: (median, min, max)}, the median of the newest table and the
    min and max over the newest `tables` tables. One run's spread understates this machine's run-to-run variation
    (up_sync_step read 1.40 and then 1.59 with no code between; docs/benchmarks.md), so the flag's margin is the
    spread of two runs."""
    text = doc.read_text() if doc.exists() else ""
    if SECTION not in text:
        return {}
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found: list[dict[str, tuple[float, float, float]]] = []
    for block in section.split("\n### ")[1:]:
        rows = {
            m.group(1): tuple(float(m.group(i)) for i in (2, 3, 4)) for m in map(_ROW.match, block.splitlines()) if m
        }
        if rows:
            found.append(rows)
    if not found:
        return {}
    newest = found[0]
    return {
        name: (
            median,
            min(t[name][1] for t in found[:tables] if name in t),
            max(t[name][2] for t in found[:tables] if name in t),
        )
        for name, (median, _, _) in newest.items()
    }


def worse(now: float, record: tuple[float, float, float]) -> bool:
    median, low, high = record
    return now - median > max(high - low, 0.05 * median)


def table(results: dict[str, list[float]], record: dict[str, tuple[float, float, float]]) -> tuple[str, list[str]]:
    lines = [
        "| figure | what (lower is better) | ratio now, median [min, max] | recorded | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    flagged = []
    for name, what in FIGURES.items():
        values = results[name]
        med = statistics.median(values)
        now = f"{med:.3f} [{min(values):.3f}, {max(values):.3f}]"
        if name in record:
            rec = "{:.3f} [{:.3f}, {:.3f}]".format(*record[name])
            verdict = "WORSE" if worse(med, record[name]) else "ok"
        else:
            rec, verdict = "none", "new"
        if verdict == "WORSE":
            flagged.append(name)
        lines.append(f"| `{name}` | {what} | {now} | {rec} | {verdict} |")
    return "\n".join(lines), flagged


def record_table(results: dict[str, list[float]], header: str, doc: Path = DOC) -> None:
    """Put this run's table first in the guard's section (older records stay below it, newest first)."""
    rows = [f"### {header}", "", "| figure | what (lower is better) | ratio, median [min, max] |"]
    rows.append("| --- | --- | --- |")
    for name, what in FIGURES.items():
        values = results[name]
        rows.append(f"| `{name}` | {what} | {statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}] |")
    text = doc.read_text()
    if SECTION not in text:
        raise SystemExit(f"{doc}: no section {SECTION!r} to record into")
    head, tail = text.split(SECTION, 1)
    section, next_sep, after = tail.partition("\n## ")
    intro, sep, older = section.partition("\n### ")
    body = intro.rstrip("\n") + "\n\n" + "\n".join(rows) + "\n"
    if sep:
        body += "\n### " + older.rstrip("\n") + "\n"
    doc.write_text(head + SECTION + body + (("\n## " + after) if next_sep else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="steps per `fleetrl up` run and bare loop")
    parser.add_argument("--warm-steps", type=int, default=300, help="supervised steps of the cached warm start")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fleetrl-guard"))
    parser.add_argument("--record", action="store_true", help="write this run's table into docs/benchmarks.md")
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="dry run: a tiny version model (the suite's check)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    if load_before > BUSY_LOAD:
        print(
            f"guard: load average {load_before:.1f} before the run: other work is on this machine, and it slows "
            "`fleetrl up`'s several processes more than the one-process baseline; run the guard on a quiet machine",
            file=sys.stderr,
        )
    args.cache.mkdir(parents=True, exist_ok=True)
    init = warm_start(args.cache, args.warm_steps)
    version_size = "tiny" if args.tiny else "113M"
    results: dict[str, list[float]] = {name: [] for name in FIGURES}
    for rep in range(args.repeats):
        run = one_repeat(init, args.cache / "runs", args.cache, version_size, args.steps, rep)
        for name, value in ratios(run).items():
            results[name].append(value)
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    header = (
        f"{datetime.date.today().isoformat()}, commit {commit.stdout.strip() or '?'}: {platform.node()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.repeats} repeats, "
        f"{time.monotonic() - started:.0f} s, load average {load_before:.1f} before"
    )
    text, flagged = table(results, recorded(args.doc))
    print(f"# {header}\n\n{text}")
    if args.record:
        record_table(results, header, args.doc)
        print(f"guard: recorded in {args.doc}", file=sys.stderr)
    if flagged:
        print(f"guard: worse than recorded by more than the recorded spread: {', '.join(flagged)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
