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
holds the record: the guard flags a figure whose median is worse than the recorded median by more than the recorded
spread (max - min; at least 5 % of the median), and exits 1 if any is flagged.
"""

from __future__ import annotations

import argparse
import asyncio
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

FIGURES = {
    "trainer_step": "trainer step / bare fwd+bwd+AdamW step (same model, same 128 samples)",
    "up_sync_step": "`fleetrl up` sync s/step / bare generate+train step",
    "up_o1_step": "`fleetrl up` O = 1 s/step / bare generate+train step",
    "up_first_step": "`fleetrl up` O = 1 launch to first step / bare loop's",
    "version_to_replica": "0.45 GB fp32 version, publish to served by one hf replica / raw ZeroMQ loopback",
}
# (hidden, layers, heads, kv heads, intermediate): 113M parameters with a 512-token vocabulary, 0.45 GB in float32.
VERSION_SHAPE = (768, 15, 12, 4, 2560)
TINY_VERSION_SHAPE = (64, 2, 2, 1, 128)


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


def _replica(model_path: str, tasks: Any, results: Any) -> None:
    """One hf replica (float32, one thread, as `fleetrl up` gives it) loading the versions it is told to."""
    import torch

    torch.set_num_threads(1)

    async def serve() -> None:
        from fleetrl.services.inference.hf_engine import HFEngine

        engine = HFEngine(model_path, dtype="float32")
        await engine.start()
        results.put(("ready", 0.0))
        while (task := await asyncio.to_thread(tasks.get)) is not None:
            address, version = task
            await engine.load_weights(version, address, timeout_s=TIMEOUT_S)
            results.put(("loaded", time.monotonic()))
        await engine.shutdown()

    asyncio.run(serve())


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


def version_model(cache: Path, shape: tuple[int, int, int, int, int]) -> Path:
    from fleetrl.tiny_model import build_tiny_model

    hidden, layers, heads, kv_heads, inter = shape
    out = cache / f"version-{hidden}x{layers}"
    if not (out / "done").exists():
        build_tiny_model(
            out,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=inter,
            max_position_embeddings=512,
        )
        (out / "done").write_text("")
    return out


def measure_version(model_path: Path) -> dict[str, float]:
    """One version from `publish` to served by one hf replica (the first version warms the path and is not
    counted), and the same bytes over raw ZeroMQ loopback."""
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.weights import WeightPublisher

    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_replica, args=(str(model_path), tasks, results), daemon=True)
    proc.start()
    try:
        assert results.get(timeout=TIMEOUT_S)[0] == "ready"
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        del model
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        serves = 0.0
        with WeightPublisher(keep_versions=1) as publisher:
            for version in (1, 2):
                with torch.no_grad():
                    next(iter(state.values())).add_(1.0)  # a new version's bytes
                started = time.monotonic()
                publisher.publish(version, state, background=True)
                tasks.put((publisher.address, version))
                kind, loaded = results.get(timeout=TIMEOUT_S)
                assert kind == "loaded"
                serves = loaded - started
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
        raw = raw_zmq_seconds(flat)
        return {"bytes": float(nbytes), "serves_s": serves, "raw_zmq_s": raw}
    finally:
        tasks.put(None)
        proc.join(60)
        if proc.is_alive():
            proc.kill()


# --- the runs ---------------------------------------------------------------------------------------------------


def one_repeat(init: Path, work: Path, version_path: Path, steps: int, rep: int) -> dict[str, dict[str, float]]:
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
    out["version"] = measure_version(version_path)
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


def recorded(doc: Path = DOC) -> dict[str, tuple[float, float, float]]:
    """The newest recorded table of the guard's section: {figure: (median, min, max)}."""
    text = doc.read_text() if doc.exists() else ""
    if SECTION not in text:
        return {}
    out: dict[str, tuple[float, float, float]] = {}
    for line in text.split(SECTION, 1)[1].splitlines():
        if line.startswith("## "):
            break
        if m := _ROW.match(line):
            out.setdefault(m.group(1), (float(m.group(2)), float(m.group(3)), float(m.group(4))))
        elif out and not line.startswith("|"):
            break  # the first (newest) table only
    return out


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
    args.cache.mkdir(parents=True, exist_ok=True)
    init = warm_start(args.cache, args.warm_steps)
    version_path = version_model(args.cache, TINY_VERSION_SHAPE if args.tiny else VERSION_SHAPE)
    results: dict[str, list[float]] = {name: [] for name in FIGURES}
    for rep in range(args.repeats):
        run = one_repeat(init, args.cache / "runs", version_path, args.steps, rep)
        for name, value in ratios(run).items():
            results[name].append(value)
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    header = (
        f"{datetime.date.today().isoformat()}, commit {commit.stdout.strip() or '?'}: {platform.node()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.repeats} repeats, "
        f"{time.monotonic() - started:.0f} s"
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
