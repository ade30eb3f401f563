"""The cookbook's config spellings: renamed fields as aliases, "off" values, refused fields naming what to use."""

from __future__ import annotations

import pytest

from fleetrl import Config, ConfigError


def test_renamed_cookbook_fields_are_aliases():
    cfg = Config.load({"lr_scheduler": "cosine", "ppo_n_minibatches": 2, "max_concurrency_rollout_sample": 16})
    assert (cfg.lr_schedule, cfg.num_minibatches, cfg.max_concurrency) == ("cosine", 2, 16)
    with pytest.raises(ConfigError, match="lr_scheduler is the cookbook's name for lr_schedule"):
        Config.load({"lr_scheduler": "cosine", "lr_schedule": "linear"})


def test_off_spellings_are_accepted():
    cfg = Config.load({"max_seq_len": None, "grad_clip_norm": 0.0, "max_completion_tokens": 100_000})
    assert cfg.max_seq_len is None and cfg.grad_clip_norm is None


@pytest.mark.parametrize(
    ("data", "advice"),
    [
        ({"tis": {"level": "token", "cap": 2.0}, "tis_cap": 3.0}, "tis.cap and tis_cap disagree"),
        ({"deployment": {"tokenizer_model": "t", "replicas": 2}}, "deployment.replicas: not a field"),
    ],
)
def test_cookbook_fields_with_another_meaning_fail_saying_what_to_use(data, advice):
    with pytest.raises(ConfigError, match=advice):
        Config.load(data)


def test_a_deploy_config_holding_only_the_tokenizer_sets_tokenizer_model():
    assert Config.load({"deployment": {"tokenizer_model": "tok"}}).tokenizer_model == "tok"


def test_strict_on_policy_is_the_default_and_group_settings_are_checked():
    cfg = Config()
    assert cfg.max_head_offpolicy_versions == 0 and cfg.min_group_size == 2
    assert cfg.max_incomplete_group_retries == 0
    with pytest.raises(ConfigError, match=r"min_group_size \(3\) must be <= completions_per_prompt \(2\)"):
        Config.load({"completions_per_prompt": 2, "min_group_size": 3})
