"""Controller start and memory on a large dataset: rows memory-mapped through HF datasets vs read into a list.

Command (from the repository root):

    python bench/dataset_scale.py [--rows 1000000] [--repeats 3] [--compare-with OTHER_CHECKOUT]

Writes a JSONL of `--rows` arithmetic-style rows (question, answer, a nested metadata dict), then, interleaved and
each in a fresh process, starts the controller's dataset side the two ways and takes 2,000 rows from the cursor:
- `in-memory`: every row parsed into a Python list (the loader fleetrl used before, `load_jsonl_rows`);
- `datasets, first start`: `load_rows` with an empty datasets cache (converts the JSONL to Arrow once);
- `datasets, cached`: `load_rows` again (the Arrow file is memory-mapped, nothing is converted).
Each process reports seconds to its first row and its peak RSS (ru_maxrss) above the interpreter with the imports.

Then, once, a whole run's worth of rows in a fresh process (`walk`): the cached dataset's every row taken through
the controller's RowScheduler and off-policy gate as a run takes it (leased, reported accepted, formed into
steps, trained, published; 8 groups of 8 per step, O = 1), with the process's resident memory above the start at
fractions of the rows, split into the heap (RssAnon) and the memory-mapped Arrow file's pages (RssFile, page cache
the kernel can drop): a flat heap means the controller holds the rows in flight, not the rows done.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(mode: str, path: str) -> None:
    import datasets  # noqa: F401  (imported before the baseline, in every mode alike)

    from fleetrl.controller.dataset import DatasetCursor, load_jsonl_rows, load_rows

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    rows = load_jsonl_rows(path) if mode == "in-memory" else load_rows(path)
    cursor = DatasetCursor(rows, epochs=1, shuffle=True, seed=0)
    first = cursor.next()
    to_first = time.perf_counter() - start
    for _ in range(1999):
        first = cursor.next()
    assert first is not None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"s_to_first_row": to_first, "peak_mb": (peak - base) / 1024, "rows": len(rows)}))


def _rss_mb() -> dict[str, float]:
    """Resident memory in MB: `anon` (the heap: what the process holds) and `file` (pages of the memory-mapped
    Arrow file read so far: the page cache, which the kernel reclaims under pressure)."""
    fields = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024
    return {"anon": fields["RssAnon"], "file": fields["RssFile"]}


def _above(now: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    return {k: now[k] - base[k] for k in now}


def walk(path: str) -> None:
    """Every row through a RowScheduler as a run takes it; RSS above the start at fractions of the rows."""
    import datasets  # noqa: F401

    from fleetrl.controller.dataset import DatasetCursor, load_rows
    from fleetrl.controller.gate import OffPolicyGate
    from fleetrl.controller.scheduler import RowScheduler

    base = _rss_mb()
    rows = load_rows(path)
    scheduler = RowScheduler(
        DatasetCursor(rows, epochs=1, shuffle=True, seed=0), OffPolicyGate(8, 8, 1), prompt_groups_per_step=8
    )
    marks = {int(len(rows) * f): f for f in (0.01, 0.1, 0.5)}
    out, done, version, start = {}, 0, 0, time.perf_counter()
    while not scheduler.finished():
        leases = scheduler.lease("gw", 64, 0.0)
        for lease in leases:
            scheduler.report(lease.row_id, "accepted", 0.0, gateway_id="gw", attempt=lease.attempt)
            done += 1
            if done in marks:
                out[f"{marks[done]:g}"] = _above(_rss_mb(), base)
        while (step := scheduler.take_step()) is not None:
            scheduler.step_trained(step)
            version += 1
            scheduler.publish(version)
        if not leases and not scheduler.finished():
            raise RuntimeError("the walk stalled")
    out["1"] = _above(_rss_mb(), base)
    out.update(rows=done, steps=version, s=time.perf_counter() - start)
    print(json.dumps(out))


def run(mode: str, path: Path, cache: Path, src: str | None = None) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
    if src:  # another checkout's fleetrl, found on sys.path before the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each start arm (0: the walk only)")
    parser.add_argument("--compare-with", help="another checkout's root: its walk runs too, for a before/after")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path = args.child
        walk(path) if mode == "walk" else child(mode, path)
        return
    work = Path(tempfile.mkdtemp(prefix="fleetrl-dataset-scale-"))
    try:
        path = work / "train.jsonl"
        with open(path, "w") as fh:
            for i in range(args.rows):
                a, b = i % 997, (i * 31) % 1009
                row = {"question": f"What is {a} + {b}?", "answer": str(a + b), "meta": {"id": i, "split": "train"}}
                fh.write(json.dumps(row) + "\n")
        print(f"{args.rows} rows, {path.stat().st_size / 2**20:.0f} MiB of JSONL", flush=True)
        results: dict[str, list[dict]] = {"in-memory": [], "datasets, first start": [], "datasets, cached": []}
        cache = work / "hf-cache"
        for _ in range(args.repeats):  # interleaved: the three arms take turns
            cache = work / "hf-cache"
            shutil.rmtree(cache, ignore_errors=True)
            results["in-memory"].append(run("in-memory", path, cache))
            results["datasets, first start"].append(run("datasets", path, cache))
            results["datasets, cached"].append(run("datasets", path, cache))
        if args.repeats:
            print_starts(results)
        print_walks(path, cache, args.compare_with)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_starts(results: dict[str, list[dict]]) -> None:
    print("| arm | s to first row | peak RSS above start (MB) |")
    print("| --- | --- | --- |")
    for arm, runs in results.items():
        secs = [r["s_to_first_row"] for r in runs]
        mbs = [r["peak_mb"] for r in runs]
        print(
            f"| {arm} | {statistics.median(secs):.2f} [{min(secs):.2f}, {max(secs):.2f}] "
            f"| {statistics.median(mbs):.0f} [{min(mbs):.0f}, {max(mbs):.0f}] |"
        )


def print_walks(path: Path, cache: Path, compare_with: str | None) -> None:
    """The walk on this checkout and, alternating, on `compare_with` (another checkout's root, e.g. a worktree
    of an older commit: its fleetrl package is imported instead)."""
    arms = {"this checkout": None} | ({f"{compare_with}": compare_with} if compare_with else {})
    run("datasets", path, cache)  # the Arrow cache exists before the walks: they measure a cached start
    walked = {arm: run("walk", path, cache, src) for arm, src in arms.items()}
    print("\n| checkout | rows taken | heap (RssAnon) above start, MB | mapped file pages (RssFile) above start, MB |")
    print("| --- | --- | --- | --- |")
    for arm, out in walked.items():
        for frac in ("0.01", "0.1", "0.5", "1"):
            print(f"| {arm} | {float(frac):.0%} | {out[frac]['anon']:.0f} | {out[frac]['file']:.0f} |")
    for arm, out in walked.items():
        print(f"{arm}: {out['rows']} rows in {out['steps']} steps, {out['s']:.0f} s")


if __name__ == "__main__":
    main()
