"""A hub dataset id the user has in the local `datasets` cache loads offline (issue 18): `owner/name` and
`owner/name:split` read the cached Arrow data memory-mapped, and a split the cache lacks is an error naming it.

No hub here: the cache is laid out as a hub download leaves it (`<cache>/<owner>___<name>/default/0.0.0/<hash>/`,
written by datasets' own JSON builder: the Arrow file and dataset_info.json), then read in a fresh process with
HF_DATASETS_CACHE pointing at it and the hub offline (datasets reads those settings when it is imported).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(7)]


def cached_hub_dataset(cache: Path, owner: str, name: str, tmp_path: Path) -> None:
    from datasets.packaged_modules.json.json import Json

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    build = tmp_path / "build"
    builder = Json(cache_dir=str(build), dataset_name=name, data_files={"train": str(data)}, hash="0123abcd")
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # build/<name>/<config id>/0.0.0/0123abcd
    target = cache / f"{owner}___{name}" / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(prepared, target)


def read(cache: Path, source: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import json, sys\n"
        "from fleetrl.controller.dataset import load_rows\n"
        "try:\n"
        f"    rows = load_rows({source!r})\n"
        "except ValueError as exc:\n"
        "    print('ERROR', exc); sys.exit(0)\n"
        "print(json.dumps({'type': type(rows).__name__, 'rows': list(rows)}))\n"
    )
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_cached_hub_dataset_loads_offline_by_its_id(tmp_path: Path) -> None:
    cache = tmp_path / "datasets-cache"
    cached_hub_dataset(cache, "fleetrl", "toy", tmp_path)
    for source in ("fleetrl/toy", "fleetrl/toy:train"):
        result = read(cache, source)
        assert result.returncode == 0, result.stderr[-2000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out == {"type": "ArrowRows", "rows": ROWS}, source
    missing = read(cache, "fleetrl/toy:test")
    assert "ERROR fleetrl/toy:test" in missing.stdout, missing.stdout + missing.stderr[-2000:]
    absent = read(cache, "fleetrl/other")
    assert "not a hub dataset in the local datasets cache" in absent.stdout
