"""fleetrl.tiny_model: the locally built model + tokenizer load faithfully and deterministically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.tiny_model import SPECIAL_TOKENS, build_tiny_model

TEXTS = [
    "Hello, world! 12 + 30 = 42.",
    "  leading spaces, trailing spaces   \n\nnew lines\tand tabs\r\n",
    "unicode: café naïve 東京 привет ∑x² 🙂 — done",
    "def f(x):\n    return x * 2  # comment\n",
    "words the corpus never saw: zyxwvut qqq 0000000001",
]


def test_tokenizer_round_trips_through_autotokenizer(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # what transformers and vLLM pick for qwen2
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert 300 <= len(tok) <= 1000


def test_special_tokens_are_single_ids_and_eos_is_set(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special)) == 1, special
    assert tok.eos_token == "<|endoftext|>"
    gen = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id


def test_chat_template_is_chatml(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_loads_with_automodel_and_matches_the_tokenizer(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM CPU needs >= 32
    logits = model(torch.tensor([tok.encode("hello")])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", arch="llama", num_layers=1)
    b = build_tiny_model(tmp_path / "b", arch="llama", num_layers=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_tiny_model(tmp_path / "c", arch="llama", num_layers=1, seed=1)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert type(AutoModelForCausalLM.from_pretrained(a)).__name__ == "LlamaForCausalLM"


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(tmp_path, hidden_size=64, num_heads=3)
