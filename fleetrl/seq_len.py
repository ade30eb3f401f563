"""The run's longest trajectory: `max_seq_len = "model"` (the default) is the model's own context length.

    resolve_max_seq_len(cfg)   # cfg.max_seq_len as an int (or None: no cap), "model" read from the model's config

"model" reads `max_position_embeddings` (or the text model's, or `n_positions` / `seq_length` /
`max_sequence_length`) from the model's config.json: a local folder's, or a hub model's from the local Hugging Face
cache; with no config to read (a name that is neither) there is no cap, and a warning says so. Every party that
applies the cap calls this with the run config: the gateway (it drops longer samples and caps `max_tokens` for the
sampler) and the controller (its messages name the cap); the trainer takes what the gateways send. Plain JSON
reading, no transformers import, so the controller stays light.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODEL = "model"
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")


def context_length(model_config: dict[str, Any]) -> int | None:
    """The positions a model config says it supports; a multimodal model's text model's; None if it says none."""
    for config in (model_config, model_config.get("text_config") or {}, model_config.get("llm_config") or {}):
        for key in _LENGTH_KEYS:
            value = config.get(key)
            if isinstance(value, int) and value > 1:
                return value
    return None


@functools.lru_cache(maxsize=16)
def model_context_length(model: str) -> int | None:
    """The context length of `model` from its config.json: a local folder's, or a hub model's from the local Hugging
    Face cache (never the network: the gateway has fetched the model's files by the time it asks). None, with a
    warning, when there is no config to read or it gives no length."""
    path = Path(model).expanduser() / "config.json"
    try:
        if not path.is_file():
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
            path = Path(cached) if isinstance(cached, str) else path
        length = context_length(json.loads(path.read_text())) if path.is_file() else None
    except (OSError, ValueError) as exc:
        logger.warning("max_seq_len = 'model': cannot read the config of %s (%s); no cap", model, exc)
        return None
    if length is None:
        logger.warning("max_seq_len = 'model': no config.json with a context length for %s; no cap", model)
    return length


def resolve_max_seq_len(cfg: Any) -> int | None:
    """`cfg.max_seq_len` as the cap to apply: an int, None (no cap), or for "model" the model's context length
    (`tokenizer_model`'s when base_model is empty; None when neither has a readable config), checked to leave room
    for max_completion_tokens."""
    value = cfg.max_seq_len
    if value != MODEL:
        return value
    model = cfg.base_model or getattr(cfg, "tokenizer_model", None)
    length = model_context_length(str(model)) if model else None
    if length is not None and cfg.max_completion_tokens >= length:
        raise ValueError(
            f"max_completion_tokens ({cfg.max_completion_tokens}) must be < max_seq_len ({length}, the context length "
            f"of {model}) to leave room for the prompt"
        )
    return length
