"""examples/distillation under `fleetrl up` on the tiny model (issue 32 part 2): a teacher with other weights and the
same tokenizer, kl_beta = 0, two steps; the teacher's logprobs reach the loss (train/reverse_kl, the student's
single-sample reverse KL to the teacher, in metrics.jsonl) whether the reference is the colocated copy or a
reference service holding the teacher."""

from __future__ import annotations

import pytest

from fleetrl.tiny_model import build_tiny_model
from tests.integration.examples.arithmetic_up import step_metrics, up_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("placement", ["trainer", "service"])
def test_the_student_is_scored_by_the_teacher_under_fleetrl_up(tiny_model_dir, tmp_path, placement):
    teacher = str(build_tiny_model(tmp_path / "teacher", seed=5))  # other weights, the same tokenizer
    extra = ["--set", f'up.reference_placement="{placement}"']
    result, log_path = up_example("distillation", tiny_model_dir, tmp_path, *extra, teacher_model=teacher)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    steps = step_metrics(log_path)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # Two random models: the student's own samples are far likelier under the student than under the teacher.
        assert m["train/reverse_kl"] > 0.5
    if placement == "service":
        assert f"model {teacher}" in (log_path / "reference.log").read_text()


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    other = str(build_tiny_model(tmp_path / "other", vocab_size=300))
    result, log_path = up_example("distillation", tiny_model_dir, tmp_path, teacher_model=other)
    assert result.returncode == 2
    assert f"teacher_model: the tokenizer of {other} differs from the run's ({tiny_model_dir})" in result.stderr
    assert not log_path.exists()
