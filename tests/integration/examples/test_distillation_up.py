"""examples/distillation under `fleetrl up` on the tiny model (issue 32 part 2): a teacher with other weights and the
same tokenizer, kl_beta = 0, two steps; the teacher's logprobs reach the loss (train/reverse_kl, the student's
single-sample reverse KL to the teacher, in metrics.jsonl) whether the reference is the colocated copy or a
reference service holding the teacher."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.tiny_model import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "distillation" / "run.toml"


def _up(tiny_model_dir: str, tmp_path: Path, *extra: str, **sets: object) -> tuple[subprocess.CompletedProcess, Path]:
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
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(CONFIG), *overrides, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, log_path


@pytest.mark.parametrize("placement", ["trainer", "service"])
def test_the_student_is_scored_by_the_teacher_under_fleetrl_up(tiny_model_dir, tmp_path, placement):
    teacher = str(build_tiny_model(tmp_path / "teacher", seed=5))  # other weights, the same tokenizer
    extra = ["--set", f'up.reference_placement="{placement}"']
    result, log_path = _up(tiny_model_dir, tmp_path, *extra, teacher_model=teacher)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    lines = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "data/samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # Two random models: the student's own samples are far likelier under the student than under the teacher.
        assert m["train/reverse_kl"] > 0.5
    if placement == "service":
        assert f"model {teacher}" in (log_path / "reference.log").read_text()


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    other = str(build_tiny_model(tmp_path / "other", vocab_size=300))
    result, log_path = _up(tiny_model_dir, tmp_path, teacher_model=other)
    assert result.returncode == 2
    assert f"teacher_model: the tokenizer of {other} differs from the run's ({tiny_model_dir})" in result.stderr
    assert not log_path.exists()
