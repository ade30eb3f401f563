"""Shared helpers of the trainer tests: a small run config and synthetic groups from the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetrl import Config
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.model import load_causal_lm
from fleetrl.trainer.synthetic import synthetic_groups


def make_cfg(model_dir: str, log_path: Path, **overrides: Any) -> Config:
    values: dict[str, Any] = {
        "base_model": model_dir,
        "log_path": str(log_path),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 16,
        "max_seq_len": 64,
        "learning_rate": 1e-3,
        "kl_beta": 0.0,
        "seed": 0,
        # These tests train groups made at version 0 in later steps too: asynchronous (the default O is 0).
        "max_head_offpolicy_versions": 1,
    }
    values.update(overrides)
    return Config(**values)


def tiny_groups(
    model_dir: str, num_groups: int = 2, group_size: int = 4, seed: int = 1, **kw: Any
) -> list[RolloutGroup]:
    """Groups whose rollout logprobs are the base model's own (so importance ratios start at 1)."""
    model = load_causal_lm(model_dir, trainable=False)
    return synthetic_groups(
        num_groups=num_groups,
        group_size=group_size,
        vocab_size=model.config.vocab_size,
        model=model,
        seed=seed,
        **kw,
    )
