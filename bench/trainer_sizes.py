"""Model sizes and the trainer config the trainer benchmarks share (trainer_throughput.py, lora_step_time.py).

Each size: a model shape for `fleetrl.tiny_model.build_tiny_model` (built locally, no download), P groups of G
samples per step, and the prompt and completion length ranges of the synthetic groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SIZES: dict[str, tuple[dict[str, int], int, int, tuple[int, int], tuple[int, int]]] = {
    "tiny": (
        dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128),
        4,
        8,
        (32, 64),
        (64, 128),
    ),
    "50m": (
        dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048),
        2,
        4,
        (32, 64),
        (64, 128),
    ),
    "100m": (
        dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
        2,
        4,
        (32, 64),
        (64, 128),
    ),
}


def bench_config(model_dir: Path, log_path: Path, size: str, **overrides: Any) -> Any:
    """A grpo Config (kl_beta 0, no weight publishing) for one step of `size`'s synthetic batch."""
    from fleetrl import Config

    _, P, G, prompt_len, completion_len = SIZES[size]
    fields: dict[str, Any] = {
        "base_model": str(model_dir),
        "log_path": str(log_path),
        "completions_per_prompt": G,
        "prompt_groups_per_step": P,
        "max_completion_tokens": completion_len[1],
        "max_seq_len": prompt_len[1] + completion_len[1] + 1,
        "policy_loss": "grpo",
        "kl_beta": 0.0,
        "weight_sync_interval": 0,
        "stale_policy": "train",  # no publishing: the step trains what it is given
        "learning_rate": 1e-5,
        **overrides,
    }
    return Config(**fields)
