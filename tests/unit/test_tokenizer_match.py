"""The teacher-tokenizer check: the same tokenizer passes; another vocabulary, a token moved to another id, or a
different eos id is refused naming the field and the first difference."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from fleetrl.tiny_model import build_tiny_model
from fleetrl.tokenizer_match import check_same_tokenizer, tokenizer_mismatch


class _Tok:
    """A stand-in with what the check reads: get_vocab() and the special-token ids."""

    def __init__(self, vocab: dict[str, int], eos: int = 0, bos: int | None = None) -> None:
        self.vocab, self.eos_token_id, self.bos_token_id = vocab, eos, bos

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_the_same_tokenizer_passes_and_a_copy_of_the_model_folder_too(tiny_model_dir, tmp_path) -> None:
    check_same_tokenizer(tiny_model_dir, tiny_model_dir)
    other_weights = build_tiny_model(tmp_path / "teacher", seed=3)  # other weights, the same tokenizer
    check_same_tokenizer(tiny_model_dir, str(other_weights))


def test_another_vocabulary_is_refused_naming_the_field(tiny_model_dir, tmp_path) -> None:
    smaller = build_tiny_model(tmp_path / "small", vocab_size=300)
    with pytest.raises(ValueError, match=r"^teacher_model: the tokenizer of .* differs .*: vocabularies of \d+ and"):
        check_same_tokenizer(tiny_model_dir, str(smaller))


def test_a_moved_token_and_a_different_eos_are_named() -> None:
    student = _Tok({"a": 0, "b": 1, "c": 2})
    assert tokenizer_mismatch(student, copy.deepcopy(student)) is None
    assert (
        tokenizer_mismatch(student, _Tok({"a": 0, "c": 1, "b": 2}))
        == "token 'b' (id 1 for the student) is id 2 for the teacher"
    )
    assert tokenizer_mismatch(student, _Tok({"a": 0, "b": 1, "d": 2})) == (
        "token 'c' (id 2 for the student) is not in the teacher's vocabulary"
    )
    assert tokenizer_mismatch(student, _Tok({"a": 0, "b": 1, "c": 2}, eos=2)) == (
        "eos_token_id 0 for the student, 2 for the teacher"
    )


def test_a_real_tokenizer_with_an_added_token_differs(tiny_model_dir) -> None:
    student = AutoTokenizer.from_pretrained(tiny_model_dir)
    teacher = AutoTokenizer.from_pretrained(tiny_model_dir)
    teacher.add_tokens(["<extra_teacher_token>"])
    assert tokenizer_mismatch(student, teacher) is not None
