"""Tiny language models built locally, for tests and benchmarks (no download ever).

`build_tiny_model(out_dir)` writes a complete Hugging Face model folder: a randomly initialised Qwen2 or Llama
causal LM (config.json, model.safetensors, generation_config.json) and a byte-level BPE tokenizer trained with
`tokenizers` on a small built-in corpus (tokenizer.json, tokenizer_config.json, chat_template.jinja).

The tokenizer is built with the exact pipeline transformers' Qwen2Tokenizer constructs (NFC normaliser, the Qwen2
split regex, byte-level pre-tokenizer and decoder), because transformers 5 and vLLM pick Qwen2Tokenizer for a
qwen2 model whatever tokenizer_config.json says; any other pipeline would be silently replaced on load. Every byte
is in the base alphabet, so any text round-trips through encode/decode.

Defaults keep head_dim = hidden_size / num_heads = 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
but not 16, and vLLM's Qwen2 ignores a `head_dim` config field.

Same arguments -> byte-identical files (seeded init, deterministic BPE training).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
# ChatML, the format Qwen2 chat models use; add_generation_prompt opens the assistant turn. With `tools` it renders
# them as Qwen2.5 does (a system turn listing them in <tools></tools>, the first system message's text or a default
# before them); an assistant turn with `tool_calls` renders each as <tool_call>\n{json}\n</tool_call> and
# consecutive `tool` messages become one user turn of <tool_response> blocks, so vLLM's `hermes` tool parser reads
# the tiny model's output. Without tools, tool calls or tool messages the text is exactly plain ChatML.
_TOOLS_INTRO = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ '" + _TOOLS_INTRO + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_OUTRO + "' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"  # already in the tools turn
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Same regex as transformers' Qwen2Tokenizer.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A policy samples tokens; the trainer scores them.
Reinforcement learning from verifiable rewards: sample a group of answers, grade each one, and
push the probability of the better answers up and the worse answers down.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i, "squared")
What is 12 + 30? The answer is 42. What is 7 * 8? The answer is 56. 3.14159 is close to pi.
User: please write a short poem about the sea.
Assistant: The sea is wide, the sea is deep, it sings the sailors off to sleep.
Weights stream from the trainer to the inference servers; each version has a checksum.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 65536. Dates like 2025-01-31 and times like 12:30.
Unicode: café, naïve, über, 東京, привет, ∑ x², emoji 🙂 — all bytes survive the round trip.
"""


def _train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus changes no merge order, only counts; one pass is enough and deterministic.
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _write_tokenizer(out: Path, tokenizer, max_len: int) -> int:
    """Save tokenizer files; return the vocab size (including special tokens)."""
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok, i in ids.items()
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_len,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special_map = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tokenizer.get_vocab_size(with_added_tokens=True)


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny random causal LM with its tokenizer to `out_dir` (created) and return the path.

    arch: "qwen2" or "llama". vocab_size is the BPE training target; the model's vocab is exactly the
    tokenizer's (a small corpus may give fewer merges than asked for).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and num_heads by "
            f"num_kv_heads ({num_kv_heads})"
        )
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (byte alphabet + specials)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_size)
    real_vocab = _write_tokenizer(out, tokenizer, max_position_embeddings)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)

    common = dict(
        vocab_size=real_vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The default init (std 0.02) gives near-uniform next-token distributions; a larger scale makes the
        # tiny model opinionated so tests see varied, peaked distributions (top-p/top-k actually cut).
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(25.0)
    model.save_pretrained(out, safe_serialization=True)
    gen = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    gen.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m fleetrl.tiny_model OUT_DIR [--arch llama]`: build a tiny model folder."""
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random HF model + tokenizer.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
