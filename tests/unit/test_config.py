from pathlib import Path

import pytest

from fleetrl import Config, ConfigError
from fleetrl.config import parse_override, read_config_file
from fleetrl.losses import LOSS_NAMES
from fleetrl.up.config import UpConfig

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_valid_and_described():
    cfg = Config()
    assert cfg.batch_size == cfg.prompt_groups_per_step * cfg.completions_per_prompt
    for name, field in Config.model_fields.items():
        assert field.description, f"field {name} has no description"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"completions_per_prompt": 1}, "completions_per_prompt"),
        ({"max_head_offpolicy_versions": -1}, "max_head_offpolicy_versions"),
        ({"completions_per_prompt": 8, "max_concurrency": 4}, "max_concurrency"),
        ({"policy_loss": "ppo2"}, "policy_loss"),
        ({"learning_rate": 0}, "learning_rate"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_completion_tokens": 4096, "max_seq_len": 1024}, "max_completion_tokens"),
        ({"num_minibatches": 100}, "num_minibatches"),
        ({"weight_sync_interval": 5, "max_head_offpolicy_versions": 1}, "weight_sync_interval"),
        (
            {"synchronous_training": True, "max_head_offpolicy_versions": 2},
            "max_head_offpolicy_versions",
        ),
        ({"weight_sync_interval": 0}, "stale_policy = 'train'"),
        ({"weight_sync_interval": 0, "stale_policy": "train", "synchronous_training": True}, "weight_sync_interval"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_configs_fail_naming_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        Config.load(data)
    assert field in str(info.value)


def test_replicas_that_never_get_weights_need_stale_samples_trained():
    assert Config(weight_sync_interval=0, stale_policy="train").weight_sync_interval == 0


def test_synchronous_training_defaults_o_to_zero():
    assert Config(synchronous_training=True).max_head_offpolicy_versions == 0


def test_every_loss_name_is_accepted():
    for name in LOSS_NAMES:
        assert Config(policy_loss=name).policy_loss == name


def test_from_toml_with_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('base_model = "m"\ncompletions_per_prompt = 4\n[rollout_extras]\nk = 3\n')
    cfg = Config.from_toml(path, overrides={"seed": 7})
    assert (cfg.base_model, cfg.completions_per_prompt, cfg.seed) == ("m", 4, 7)
    assert cfg.rollout_extras == {"k": 3}
    path.write_text("completions_per_prompt = 1\n")
    with pytest.raises(ConfigError, match="completions_per_prompt"):
        Config.from_toml(path)
    with pytest.raises(ConfigError, match="not found"):
        Config.from_toml(tmp_path / "missing.toml")
    path.write_text("x = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.from_toml(path)


def test_parse_override_reads_toml_values():
    assert parse_override("seed=3") == ("seed", 3)
    assert parse_override("top_p=0.9") == ("top_p", 0.9)
    assert parse_override("base_model=./m") == ("base_model", "./m")
    assert parse_override("shuffle=false") == ("shuffle", False)
    with pytest.raises(ConfigError):
        parse_override("seed")


def test_sample_kwargs():
    cfg = Config(max_completion_tokens=32, temperature=0.7, top_p=0.9, top_k=5)
    assert cfg.sample_kwargs == {"max_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 5}


def _shipped_run_configs() -> list[Path]:
    """Every TOML run config the repo ships (pyproject.toml and run folders aside)."""
    skip = {"pyproject.toml"}
    return sorted(
        p
        for p in REPO.rglob("*.toml")
        if p.name not in skip and not {".git", "runs", "node_modules"} & set(p.relative_to(REPO).parts)
    )


def test_every_shipped_run_config_parses():
    # prime-rl's test_configs habit: any TOML config the repo ships must load, its [up] table too.
    shipped = _shipped_run_configs()
    # The examples and the compose file's config: a glob that finds nothing must fail, not pass.
    assert len(shipped) >= 6, f"expected the shipped run configs, found {shipped}"
    assert REPO / "docker" / "example" / "run.toml" in shipped
    for path in shipped:
        Config.from_toml(path)
        if "up" in read_config_file(path):
            UpConfig.from_file(path)


def test_docs_list_every_field():
    text = (REPO / "docs" / "config.md").read_text()
    missing = [name for name in Config.model_fields if f"`{name}`" not in text]
    assert not missing, f"docs/config.md does not document: {missing}"
    up_table = text[text.index("## The `[up]` table") :]
    missing = [name for name in UpConfig.model_fields if f"`{name}`" not in up_table]
    assert not missing, f"docs/config.md's [up] table does not document: {missing}"


@pytest.mark.parametrize("field", ["temperature", "learning_rate", "top_p", "kl_beta", "grad_clip_norm"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_fail_at_start_naming_the_field(field, value):
    # temperature = inf used to be accepted, and every Generate then failed.
    with pytest.raises(ConfigError, match=rf"{field}: Input should be a finite number"):
        Config.load({field: value})


def test_non_finite_numbers_fail_in_service_configs_too():
    from fleetrl.config import build_service_config
    from fleetrl.gateway.config import GatewayConfig

    with pytest.raises(ConfigError, match="rollout_timeout_s: Input should be a finite number"):
        build_service_config(GatewayConfig, {"run": Config(), "rollout": "m:f", "rollout_timeout_s": float("nan")}, "g")
