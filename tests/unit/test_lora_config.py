"""The LoRA settings of the run config: bad combinations fail at start naming the field, a warm-start adapter is
checked where the trainer reads it, and a LoRA run with kl_beta > 0 needs no reference service."""

from __future__ import annotations

import json

import pytest

from fleetrl.config import Config, ConfigError, check_warm_start_adapter
from fleetrl.services.trainer.config import TrainerConfigError, TrainerServiceConfig
from fleetrl.services.trainer.launcher import build_parser, config_from_args
from fleetrl.up.run import needs_reference


def test_defaults_are_full_fine_tuning():
    cfg = Config()
    assert cfg.lora_rank == 0 and not cfg.lora
    assert cfg.lora_target_modules == "all-linear" and cfg.lora_dropout == 0.0 and cfg.export_merged is False


def test_lora_settings_load_from_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nlora_rank = 16\nlora_alpha = 32\nlora_dropout = 0.05\nlora_target_modules = ["q_proj"]\n')
    cfg = Config.from_toml(path)
    assert (cfg.lora_rank, cfg.lora_scale_alpha, cfg.lora_dropout) == (16, 32.0, 0.05)
    assert cfg.lora_target_modules == ["q_proj"]
    assert Config(lora_rank=8).lora_scale_alpha == 16.0  # default alpha: 2 * rank


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lora_alpha", 16),
        ("lora_dropout", 0.1),
        ("lora_target_modules", ["q_proj"]),
        ("warm_start_from_adapter", "/some/adapter"),
        ("export_merged", True),
    ],
)
def test_lora_settings_without_a_rank_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"{field} is a LoRA setting: it needs lora_rank > 0"):
        Config.load({field: value})


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"lora_rank": -1}, "lora_rank"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout"),
        ({"lora_rank": 8, "lora_target_modules": []}, "lora_target_modules"),
        ({"lora_rank": 8, "lora_target_modules": "all"}, "lora_target_modules"),
    ],
)
def test_bad_lora_values_name_the_field(values, field):
    with pytest.raises(ConfigError, match=field):
        Config.load(values)


def _adapter(folder, **config):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **config})
    )
    return str(folder)


def test_warm_start_adapter_checks(tmp_path):
    good = _adapter(tmp_path / "good")
    assert check_warm_start_adapter(Config(lora_rank=8, warm_start_from_adapter=good))["r"] == 8
    assert check_warm_start_adapter(Config(lora_rank=8)) is None
    (tmp_path / "empty").mkdir()
    cases = [
        (Config(lora_rank=8, warm_start_from_adapter=str(tmp_path / "missing")), "no adapter folder"),
        (Config(lora_rank=8, warm_start_from_adapter=str(tmp_path / "empty")), "has no adapter_config.json"),
        (Config(lora_rank=4, warm_start_from_adapter=good), "the adapter's rank is 8, but lora_rank = 4"),
        (Config(lora_rank=8, lora_alpha=8, warm_start_from_adapter=good), "lora_alpha is 16, but lora_alpha = 8"),
        (
            Config(lora_rank=8, lora_target_modules=["q_proj"], warm_start_from_adapter=good),
            "the adapter targets",
        ),
        (Config(lora_rank=8, warm_start_from_adapter=_adapter(tmp_path / "ia3", peft_type="IA3")), "not a LoRA"),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=rf"warm_start_from_adapter: .*{message}"):
            check_warm_start_adapter(cfg)
    # The adapter's own settings are taken when the run leaves them unset, or states the same.
    same = Config(lora_rank=8, lora_alpha=16, lora_target_modules=["v_proj", "q_proj"], warm_start_from_adapter=good)
    assert check_warm_start_adapter(same) is not None


def test_the_trainer_service_refuses_a_missing_warm_start_adapter(tmp_path):
    run = Config(base_model="m", lora_rank=8, warm_start_from_adapter=str(tmp_path / "nope"))
    with pytest.raises(TrainerConfigError, match="warm_start_from_adapter: no adapter folder"):
        TrainerServiceConfig.build({"run": run})


def test_lora_with_kl_needs_no_reference_service():
    lora = Config(base_model="m", kl_beta=0.01, lora_rank=8)
    full = Config(base_model="m", kl_beta=0.01)
    assert TrainerServiceConfig.build({"run": lora}).reference is None
    with pytest.raises(TrainerConfigError, match=r"reference: run\.kl_beta"):
        TrainerServiceConfig.build({"run": full})
    assert not needs_reference(lora) and needs_reference(full)
    assert not needs_reference(Config(kl_beta=0.0))
    # Standalone replay: full fine-tuning gets a local frozen copy, LoRA none (its adapter is switched off instead).
    argv = ["--set", "base_model='m'", "--set", "kl_beta=0.01", "--standalone", "groups.jsonl"]
    assert config_from_args(build_parser().parse_args(argv)).reference == "local"
    argv += ["--set", "lora_rank=8"]
    assert config_from_args(build_parser().parse_args(argv)).reference is None


def test_fleetrl_up_refuses_a_missing_warm_start_adapter_before_starting_anything(tmp_path, tiny_model_dir, capsys):
    from fleetrl.up.run import main

    path = tmp_path / "run.json"
    run = {"base_model": tiny_model_dir, "lora_rank": 8, "warm_start_from_adapter": str(tmp_path / "nope")}
    path.write_text(json.dumps({"run": run, "up": {"rollout": "m:f"}}))
    assert main([str(path)]) == 2
    assert "warm_start_from_adapter: no adapter folder" in capsys.readouterr().err
