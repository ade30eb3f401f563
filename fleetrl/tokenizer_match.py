"""Whether a second model (a distillation teacher, a judge scoring token ids) reads token ids as the run's model does.

A teacher scores the student's sampled token ids: its logprob of id k is only meaningful if k is the same token for
both. `tokenizer_mismatch` says why two tokenizers would disagree (a different vocabulary, a token mapped to another
id, different special-token ids), or None; `check_same_tokenizer` loads two tokenizers and raises a ValueError naming
the config field when they disagree, for a service to call at start.

    check_same_tokenizer("runs/student", "runs/teacher", field="teacher_model")
"""

from __future__ import annotations

from typing import Any

SPECIAL_IDS = ("bos_token_id", "eos_token_id")
"""Special tokens whose ids must agree (the pad id may differ: padding is never scored)."""


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why `teacher` (an HF tokenizer) would not map ids to the tokens `student` does; None when they agree."""
    vocab_s, vocab_t = student.get_vocab(), teacher.get_vocab()
    if len(vocab_s) != len(vocab_t):
        return f"vocabularies of {len(vocab_s)} and {len(vocab_t)} tokens"
    for token, index in sorted(vocab_s.items(), key=lambda item: item[1]):
        other = vocab_t.get(token)
        if other != index:
            where = "is not in the teacher's vocabulary" if other is None else f"is id {other} for the teacher"
            return f"token {token!r} (id {index} for the student) {where}"
    for name in SPECIAL_IDS:
        a, b = getattr(student, name, None), getattr(teacher, name, None)
        if a != b:
            return f"{name} {a} for the student, {b} for the teacher"
    return None


def check_same_tokenizer(student_path: str, teacher_path: str, field: str = "teacher_model") -> None:
    """Load both tokenizers and raise a ValueError naming `field` when the teacher's would read ids otherwise."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoTokenizer.from_pretrained(teacher_path)
    why = tokenizer_mismatch(student, teacher)
    if why is not None:
        raise ValueError(
            f"{field}: the tokenizer of {teacher_path} differs from the run's ({student_path}): {why}; a teacher "
            "scores the student's token ids, so it needs the same tokenizer"
        )
