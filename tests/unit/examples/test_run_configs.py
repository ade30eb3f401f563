"""Every example's run.toml is a valid `fleetrl up` config whose rollout factory loads, and the shipped rows files
are what the examples' train.py writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetrl import Config, ConfigError, RolloutSetup
from fleetrl.up.config import UpConfig
from fleetrl.user_code import load_object
from tests.unit.examples.helpers import EXAMPLES, ScriptedSampler, load_example_module

NAMES = ["single_turn_token_in", "multi_turn_message_in", "gsm8k", "tool_use", "openai_agent"]
REPO = EXAMPLES.parent


@pytest.mark.parametrize("name", NAMES)
def test_run_toml_loads_and_its_factory_builds(name, tokenizer):
    path = EXAMPLES / name / "run.toml"
    run, up = Config.from_toml(path), UpConfig.from_file(path)
    assert run.log_path == f"runs/{name.removesuffix('_token_in').removesuffix('_message_in')}"
    assert run.base_model == "runs/tiny_model" and run.kl_beta == 0.0
    Config.from_toml(path, {"synchronous_training": True})  # the documented sync switch is accepted
    module, _, attr = up.rollout.rpartition(":")
    rollout_file = path.parent / module  # fleetrl up reads [up].rollout relative to the toml's folder
    assert rollout_file.is_file()
    factory = load_object(f"{rollout_file}:{attr}")
    sampler = ScriptedSampler(tokenizer, [])
    extras = dict(run.rollout_extras)
    assert callable(factory(RolloutSetup(tokenizer=tokenizer, sampler=sampler, extras=extras)))
    if name != "single_turn_token_in":  # its rows are token ids of one tokenizer: train.py --write-rows makes them
        assert (REPO / run.dataset).is_file()


def test_multi_turn_rollout_budget_matches_max_seq_len():
    run = Config.from_toml(EXAMPLES / "multi_turn_message_in" / "run.toml")
    assert run.rollout_extras["max_seq_len"] == run.max_seq_len


@pytest.mark.parametrize("name", ["multi_turn_message_in", "tool_use"])
def test_shipped_rows_are_train_py_rows(name):
    train = load_example_module(name, "train")
    path = Path(EXAMPLES / name / "problems.jsonl")
    shipped = train.read_rows(str(path))
    assert shipped == json.loads(json.dumps(train.make_rows(len(shipped), seed=0)))  # regenerable, as documented


@pytest.mark.parametrize("name", NAMES)
def test_train_py_flags_build_the_config(name, tmp_path):
    train = load_example_module(name, "train")
    argv = ["--model", "m", "--steps", "2", "--log-path", str(tmp_path), "--set", "completions_per_prompt=3"]
    if name == "gsm8k":
        argv += ["--data", str(EXAMPLES / "gsm8k" / "sample.jsonl")]
    cfg = train.build_config(train.parse_args(argv))
    assert (cfg.base_model, cfg.max_steps, cfg.log_path, cfg.completions_per_prompt) == ("m", 2, str(tmp_path), 3)
    with pytest.raises(ConfigError, match="completions_per_prompt"):
        train.build_config(train.parse_args([*argv, "--set", "completions_per_prompt=1"]))
