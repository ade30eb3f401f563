"""The controller's start-up reads a small JSONL dataset without importing HF `datasets` (issue 40 item 1: `import
datasets`, with pandas and pyarrow, was about 1 s of CPU on the way to the first step, which `fleetrl up` pays after
the trainer is ready); a file over the size limit still goes through Arrow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROWS = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(50)]

PROBE = """
import json, sys
from fleetrl.controller.dataset import load_rows
from fleetrl.controller.rows import open_rows
rows = load_rows(sys.argv[1], max_rows=int(sys.argv[2]))
imported = "datasets" in sys.modules
big = open_rows(sys.argv[1], in_memory_bytes=int(sys.argv[3])) if int(sys.argv[3]) >= 0 else None
print(json.dumps({"rows": list(rows), "imported": imported, "big": type(big).__name__, "big_rows": len(big or [])}))
"""


def probe(path: Path, max_rows: int, big_limit: int, tmp_path: Path) -> dict:
    env_cache = {"HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), str(max_rows), str(big_limit)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env_cache},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_small_jsonl_loads_without_importing_datasets(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = probe(path, 7, -1, tmp_path)
    assert out["rows"] == ROWS[:7]
    assert out["imported"] is False, "reading a 50-row JSONL imported datasets"


def test_a_jsonl_over_the_limit_goes_through_arrow(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = probe(path, 3, path.stat().st_size - 1, tmp_path)
    assert out["rows"] == ROWS[:3] and out["imported"] is False
    assert out["big"] == "ArrowRows" and out["big_rows"] == len(ROWS)
