"""fleetrl.cookbook: `Config(trainer=TrainerConfig(...), deployment=DeployConfig(...), wandb=WandBConfig(...))` maps
onto fleetrl's fields; what is Fireworks infrastructure fails naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleetrl import Config, ConfigError, DeployConfig, TrainerConfig, WandBConfig
from fleetrl.up.config import load_run_and_up


def test_the_cookbook_objects_set_fleetrls_fields():
    cfg = Config(
        ppo_n_minibatches=2,
        max_concurrency_rollout_sample=None,
        output_model_id=None,
        trainer=TrainerConfig(training_shape_id=None),
        deployment=DeployConfig(tokenizer_model="tok", replica_count=2),
        wandb=WandBConfig(entity="", project="proj", run_name="run-1"),
    )
    assert (cfg.tokenizer_model, cfg.num_minibatches, cfg.max_concurrency) == ("tok", 2, None)
    assert (cfg.wandb_entity, cfg.wandb_project, cfg.wandb_run_name) == (None, "proj", "run-1")
    assert cfg.loggers == ["jsonl", "wandb"]
    assert cfg.cookbook_up_options == {"replicas": 2}
    assert Config(wandb=WandBConfig(entity="team")).loggers == ["jsonl"]  # no project: no W&B
    assert Config().cookbook_up_options == {}


def test_the_same_names_work_as_toml_tables(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[run]\nbase_model = "m"\n[run.deployment]\nreplica_count = 3\ntokenizer_model = "tok"\n'
        '[run.wandb]\nproject = "p"\n[up]\nrollout = "r.py:f"\n'
    )
    run, up, _ = load_run_and_up(path, [])
    assert (run.tokenizer_model, run.wandb_project, up.replicas) == ("tok", "p", 3)
    run, up, _ = load_run_and_up(path, ["up.replicas=1"])
    assert up.replicas == 1  # [up] and --set up.* win over the cookbook table


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"trainer": TrainerConfig(training_shape_id="accounts/x/trainingShapes/y")}, "trainer_procs / trainer_gpus"),
        ({"output_model_id": "accounts/me/models/m"}, "output_model_id: .* use output_dir"),
        ({"deployment": {"tokenizer_model": "t", "replicas": 2}}, "deployment.replicas: not a field"),
        ({"wandb": {"projekt": "p"}}, "wandb.projekt: not a field"),
        ({"deployment": DeployConfig(tokenizer_model="a"), "tokenizer_model": "b"}, "disagree"),
    ],
)
def test_what_fleetrl_cannot_honour_fails_naming_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        Config(**fields)
    with pytest.raises(ConfigError, match=message):
        Config.load(fields)


def test_the_objects_refuse_unknown_fields_themselves():
    with pytest.raises(ValidationError, match="deployment_id"):
        DeployConfig(deployment_id="d")
    with pytest.raises(ValidationError, match="replica_count"):
        DeployConfig(replica_count=0)


def test_main_starts_the_replicas_deploy_config_asks_for(tmp_path, capsys):
    import fleetrl

    cfg = Config(log_path=str(tmp_path / "run"), base_model="m", deployment=DeployConfig(replica_count=2))
    # One GPU list for two replicas: refused before anything starts, which shows main() took replica_count.
    summary = fleetrl.main(cfg, rollout_fn_factory="rollout.py:f", inference_gpus=[[0]])
    assert summary["exit_code"] == 2
    assert "inference_gpus has 1 lists but replicas is 2" in capsys.readouterr().err
