"""max_seq_len defaults to the model's context length (issue 26): "model" reads max_position_embeddings from the
model's config.json; a number or None (no cap) stays as given."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fleetrl import Config
from fleetrl.rollout import RolloutSetup
from fleetrl.seq_len import context_length, model_context_length, resolve_max_seq_len


def model_dir(tmp_path: Path, config: dict) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    model_context_length.cache_clear()
    return str(folder)


def test_the_default_is_the_models_context_length(tmp_path):
    cfg = Config(base_model=model_dir(tmp_path, {"max_position_embeddings": 32768}), dataset="unused")
    assert cfg.max_seq_len == "model"
    assert resolve_max_seq_len(cfg) == 32768
    # What the gateway hands the rollout and applies to each group (fleetrl.gateway.worker) is that length.
    assert RolloutSetup.for_run(cfg, None, None).max_seq_len == 32768  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [(300, 300), (None, None)])
def test_a_number_or_none_is_kept(tmp_path, value, expected):
    cfg = Config(base_model=model_dir(tmp_path, {"max_position_embeddings": 32768}), max_seq_len=value)
    assert resolve_max_seq_len(cfg) == expected


def test_multimodal_and_other_spellings_of_the_length():
    assert context_length({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert context_length({"n_positions": 1024}) == 1024
    assert context_length({"hidden_size": 64}) is None


def test_a_model_shorter_than_the_completions_fails_naming_both(tmp_path):
    cfg = Config(base_model=model_dir(tmp_path, {"max_position_embeddings": 128}), max_completion_tokens=256)
    with pytest.raises(ValueError, match=r"max_completion_tokens \(256\) must be < max_seq_len \(128"):
        resolve_max_seq_len(cfg)


def test_an_unreadable_model_config_means_no_cap_and_says_so(tmp_path, caplog):
    cfg = Config(base_model=str(tmp_path / "not-there"))
    model_context_length.cache_clear()
    with caplog.at_level(logging.WARNING, logger="fleetrl.seq_len"):
        assert resolve_max_seq_len(cfg) is None
    assert "no cap" in caplog.text


def test_a_bad_value_fails_naming_the_field():
    with pytest.raises(ValueError, match="max_seq_len"):
        Config(base_model="x", max_seq_len="auto")
