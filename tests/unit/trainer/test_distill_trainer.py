"""The policy trainer under on-policy distillation (issue 32 part 2): with `teacher_model` the reference holds the
teacher (a colocated copy loads it, a reference service is asked for its logprobs) even with kl_beta = 0, the loss
mixes its signal per distill_weight, and a teacher with another tokenizer is refused naming both models."""

from __future__ import annotations

import pytest
import torch

from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.tiny_model import build_tiny_model
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from tests.unit.trainer.helpers import make_cfg, tiny_groups


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Other weights, the same tokenizer (build_tiny_model trains the same BPE for any seed)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=5))


def test_a_teacher_is_asked_for_logprobs_even_without_kl_and_its_signal_trains(tiny_model_dir, teacher_dir, tmp_path):
    teacher = load_causal_lm(teacher_dir, trainable=False)
    calls: list[int] = []

    def teacher_service(sequences, temperature):
        calls.append(len(sequences))
        return sequence_logprobs(teacher, sequences, temperature=temperature)

    cfg = make_cfg(tiny_model_dir, tmp_path, teacher_model=teacher_dir, kl_beta=0.0, distill_weight=0.5)
    trainer = PolicyTrainer(cfg, ref_logprobs_fn=teacher_service)
    metrics = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2)).metrics
    assert calls == [8]  # every sample of the step scored by the teacher
    # The student's own samples: old - teacher per token, positive on average (the student prefers its own).
    assert metrics["train/reverse_kl"] > 0
    trainer.close()


def test_without_a_teacher_and_without_kl_no_reference_is_asked(tiny_model_dir, tmp_path):
    calls: list[int] = []
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path), ref_logprobs_fn=lambda s, t: calls.append(1))
    metrics = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2)).metrics
    assert calls == [] and "train/reverse_kl" not in metrics
    trainer.close()


def test_the_colocated_reference_holds_the_teacher(tiny_model_dir, teacher_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, teacher_model=teacher_dir, kl_beta=0.0)
    trainer = PolicyTrainer(cfg, colocated_reference=True)
    assert trainer.reference_model is not None
    teacher = load_causal_lm(teacher_dir, trainable=False)
    ours = dict(trainer.reference_model.named_parameters())
    for name, param in teacher.named_parameters():
        torch.testing.assert_close(ours[name], param)
    assert not torch.equal(next(trainer.model.parameters()), next(teacher.parameters()))  # the student is not
    metrics = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2)).metrics
    assert metrics["train/reverse_kl"] > 0
    trainer.close()


def test_a_colocated_teacher_with_another_tokenizer_is_refused_naming_both(tiny_model_dir, tmp_path):
    other = str(build_tiny_model(tmp_path / "other", vocab_size=300))
    cfg = make_cfg(tiny_model_dir, tmp_path / "run", teacher_model=other, kl_beta=0.0)
    with pytest.raises(ValueError, match=r"^teacher_model: the tokenizer of .*other differs from the run's"):
        PolicyTrainer(cfg, colocated_reference=True)


def test_the_trainer_service_wants_a_reference_for_a_teacher(tiny_model_dir, teacher_dir, tmp_path):
    run = make_cfg(tiny_model_dir, tmp_path, teacher_model=teacher_dir, kl_beta=0.0)
    with pytest.raises(ValueError, match=r"reference: .*teacher_model"):
        TrainerServiceConfig(run=run)
    assert TrainerServiceConfig(run=run, reference="local").reference == "local"


def test_distilling_through_teacher_model_moves_the_student_toward_the_teacher(tiny_model_dir, tmp_path):
    # The run-level path end to end in one process: teacher_model names a folder, the colocated reference loads it,
    # kl_beta = 0, a built-in loss (grpo) with distill_weight = 1. The teacher is the student's weights perturbed
    # (same tokenizer), as in tests/unit/losses/test_distill.py; the full-vocabulary KL(student || teacher) on
    # held-out student samples falls.
    from transformers import AutoTokenizer

    from tests.unit.losses.test_distill import _kl_to_teacher, _student_groups

    teacher = load_causal_lm(tiny_model_dir, trainable=False)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
    teacher_path = tmp_path / "teacher"
    teacher.save_pretrained(teacher_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(teacher_path)
    cfg = make_cfg(
        tiny_model_dir,
        tmp_path / "run",
        teacher_model=str(teacher_path),
        kl_beta=0.0,
        policy_loss="grpo",
        learning_rate=3e-4,
        prompt_groups_per_step=8,
        completions_per_prompt=16,
    )
    trainer = PolicyTrainer(cfg, colocated_reference=True)
    held_out = torch.tensor([group.samples[0].tokens for group in _student_groups(trainer.model, 99, 0)])
    before = _kl_to_teacher(trainer.model, teacher, held_out, prompt=4)
    for step in range(8):
        metrics = trainer.train_step(_student_groups(trainer.model, step, trainer.version, groups_n=8, size=16)).metrics
        assert metrics["train/reverse_kl"] > 0
    after = _kl_to_teacher(trainer.model, teacher, held_out, prompt=4)
    assert after < 0.85 * before, f"KL(student || teacher) {before:.4f} -> {after:.4f}"
    trainer.close()
