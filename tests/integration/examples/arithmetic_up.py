"""`fleetrl up` of an example's run.toml on the tiny model, for two steps of small arithmetic rows: the shared set-up
of the examples' end-to-end tests (custom loss, distillation, judge pool)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def up_example(
    example: str, tiny_model_dir: str, tmp_path: Path, *extra: str, **sets: object
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run `examples/<example>/run.toml` with 16 rows "a+b=", two steps of 2 x 2 samples, `sets` as `--set`
    overrides (a key with an `up.` prefix sets the [up] table), from `tmp_path` (an example's own files are found
    through its config's folder, not the working directory). Returns the result and the run's log_path."""
    rows = tmp_path / "rows.jsonl"
    rng = random.Random(0)
    pairs = [(rng.randint(0, 49), rng.randint(0, 49)) for _ in range(16)]
    rows.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    log_path = tmp_path / "run"
    values = {
        "base_model": tiny_model_dir,
        "dataset": str(rows),
        "eval_dataset": str(rows),
        "evaluation_interval": 0,
        "log_path": str(log_path),
        "max_steps": 2,
        "lr_warmup_steps": 0,
        "completions_per_prompt": 2,
        "prompt_groups_per_step": 2,
        **sets,
    }
    overrides = [a for k, v in values.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    config = REPO / "examples" / example / "run.toml"
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(config), *overrides, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, log_path


def step_metrics(log_path: Path) -> list[dict]:
    """metrics.jsonl's trained steps."""
    lines = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "data/samples" in m]
