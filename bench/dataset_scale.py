"""Controller start and memory on a large dataset: rows memory-mapped through HF datasets vs read into a list.

Command (from the repository root):

    python bench/dataset_scale.py [--rows 1000000] [--repeats 3]

Writes a JSONL of `--rows` arithmetic-style rows (question, answer, a nested metadata dict), then, interleaved and
each in a fresh process, starts the controller's dataset side the two ways and takes 2,000 rows from the cursor:
- `in-memory`: every row parsed into a Python list (the loader fleetrl used before, `load_jsonl_rows`);
- `datasets, first start`: `load_rows` with an empty datasets cache (converts the JSONL to Arrow once);
- `datasets, cached`: `load_rows` again (the Arrow file is memory-mapped, nothing is converted).
Each process reports seconds to its first row and its peak RSS (ru_maxrss) above the interpreter with the imports.
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


def run(mode: str, path: Path, cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
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
        for _ in range(args.repeats):  # interleaved: the three arms take turns
            cache = work / "hf-cache"
            shutil.rmtree(cache, ignore_errors=True)
            results["in-memory"].append(run("in-memory", path, cache))
            results["datasets, first start"].append(run("datasets", path, cache))
            results["datasets, cached"].append(run("datasets", path, cache))
        print("| arm | s to first row | peak RSS above start (MB) |")
        print("| --- | --- | --- |")
        for arm, runs in results.items():
            secs = [r["s_to_first_row"] for r in runs]
            mbs = [r["peak_mb"] for r in runs]
            print(
                f"| {arm} | {statistics.median(secs):.2f} [{min(secs):.2f}, {max(secs):.2f}] "
                f"| {statistics.median(mbs):.0f} [{min(mbs):.0f}, {max(mbs):.0f}] |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
