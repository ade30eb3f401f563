"""A run's tokenizer and vocabulary size, read without importing torch where the answer is certain (the gateways).

    tokenizer = load_tokenizer("path/to/model")     # the class AutoTokenizer.from_pretrained picks, same files
    vocab = config_vocab_size("path/to/model")      # config.json's vocab_size, as AutoConfig reads it

In transformers 5 `from transformers import AutoTokenizer` (and `AutoConfig`) imports the auto-model registry and
with it torch, torch._dynamo and torch.distributed: about 4 s of CPU (5.3 s against 1.4 s for the tokenizer's own
class, measured on the 2-core VM) in a gateway process that never uses torch, while the trainer and the replicas
load beside it on the same cores before the first step (issue 40 item 1). For a local model folder whose
tokenizer_config.json names one of transformers' own classes for the folder's model type
(`transformers.models.<model_type>`), with no remote code, AutoTokenizer ends in that class's `from_pretrained`, so
that class is loaded directly; anything else (a hub id, remote code, a generic or another model's class, no
tokenizer_config.json) goes through AutoTokenizer as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Generic classes: AutoTokenizer resolves these through the model type's registry, which only it holds.
_GENERIC = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer"}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def own_tokenizer_class(name_or_path: str | Path) -> type | None:
    """The tokenizer class AutoTokenizer picks for a local model folder, found without importing AutoTokenizer,
    when that is certain (see the module docstring); None when only AutoTokenizer can say."""
    folder = Path(name_or_path)
    if not folder.is_dir():
        return None
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    if tokenizer_config is None or model_config is None:
        return None
    name, model_type = tokenizer_config.get("tokenizer_class"), model_config.get("model_type")
    if not isinstance(name, str) or not isinstance(model_type, str) or "auto_map" in tokenizer_config:
        return None
    name = name.removesuffix("Fast")
    if name in _GENERIC:
        return None
    import transformers

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        return None
    if not isinstance(cls, type) or not cls.__module__.startswith(f"transformers.models.{model_type}."):
        return None
    return cls


def load_tokenizer(name_or_path: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(name_or_path)`, without importing AutoTokenizer when the class is certain."""
    cls = own_tokenizer_class(name_or_path)
    if cls is not None:
        return cls.from_pretrained(str(Path(name_or_path).resolve()))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path))


def config_vocab_size(name_or_path: str | Path) -> int:
    """The model's embedding rows: config.json's top-level `vocab_size` of a local folder, else
    `AutoConfig.from_pretrained(name_or_path).vocab_size` (OSError, ValueError or AttributeError when there is none)."""
    config = _read_json(Path(name_or_path) / "config.json") if Path(name_or_path).is_dir() else None
    vocab = config.get("vocab_size") if config is not None else None
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        return vocab
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(name_or_path)).vocab_size)
