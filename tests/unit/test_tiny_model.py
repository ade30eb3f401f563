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


# The tiny model's template before it rendered tools: plain ChatML, which it must still render exactly.
_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\n d"}],
    [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "x", "tool_calls": None},
        {"role": "system", "content": "s2"},
        {"role": "user", "content": "café 🙂 {{ }} '\""},
    ],
]
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("messages", _CONVERSATIONS)
def test_without_tools_the_template_renders_plain_chatml_token_for_token(tiny_model_dir: str, messages) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for generation_prompt in (True, False):
        for tools in ({}, {"tools": None}):
            kwargs = {"add_generation_prompt": generation_prompt, "tokenize": False, **tools}
            text = tok.apply_chat_template(messages, **kwargs)
            assert text == tok.apply_chat_template(messages, chat_template=_CHATML, **kwargs)
            assert tok.encode(text) == tok.encode(tok.apply_chat_template(messages, chat_template=_CHATML, **kwargs))


def test_the_template_renders_tools_calls_and_responses_as_qwen25(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    text = tok.apply_chat_template(messages, tools=_TOOLS, tokenize=False, add_generation_prompt=True)
    head, rest = text.split("<tools>\n", 1)
    assert head.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and head.count("Be brief.") == 1
    assert rest.startswith(json.dumps(_TOOLS[0]) + "\n</tools>")
    assert text.endswith(
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant"
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    no_system = tok.apply_chat_template(messages[1:2], tools=_TOOLS, tokenize=False)
    assert no_system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")


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
