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


# --- the current recipe's Config (fw-ai/cookbook #570, training/recipes/async_rl_loop.py) -----------------------


def test_the_current_multi_turn_recipes_config_call_loads():
    # training/examples/rl/multi_turn_message_in/train.py as the cookbook writes it (model and ids changed).
    cfg = Config(
        log_path="./gsm8k_mt_logs",
        base_model="m",
        learning_rate=1.7e-5,
        kl_beta=0.0,
        completions_per_prompt=4,
        max_completion_tokens=1024,
        temperature=1.0,
        epochs=1,
        max_rows=512,
        lora_rank=0,
        prompt_groups_per_step=8,
        max_head_offpolicy_versions=0,
        pipeline_chunks_per_step=1,
        max_concurrency_rollout_sample=None,
        output_model_id=None,
        trainer=TrainerConfig(training_shape_id=None),
        deployment=DeployConfig(tokenizer_model="tok", replica_count=None),
        wandb=WandBConfig(entity="", project=None, run_name="gsm8k-mt-1"),
    )
    assert (cfg.completions_per_prompt, cfg.prompt_groups_per_step, cfg.max_rows) == (4, 8, 512)


def test_tis_config_sets_fleetrls_tis_fields_as_object_table_or_the_cookbooks_dataclass(tmp_path):
    import dataclasses

    from fleetrl.cookbook import TISConfig

    cfg = Config(tis=TISConfig(cap=2.0, level="sequence"))
    assert (cfg.tis_level, cfg.tis_cap, cfg.icepop_threshold) == ("sequence", 2.0, None)
    assert Config(tis=TISConfig(icepop_threshold=2.0)).icepop_threshold == 2.0
    assert (Config().tis_level, Config().tis_cap) == (TISConfig().level, TISConfig().cap)  # the same defaults

    @dataclasses.dataclass(frozen=True)
    class CookbookTIS:  # the shape of training.utils.rl.tis.TISConfig
        cap: float = 5.0
        level: str = "token"
        icepop_threshold: float | None = None

    assert Config(tis=CookbookTIS(cap=3.0)).tis_cap == 3.0
    path = tmp_path / "run.toml"
    path.write_text('[run]\nbase_model = "m"\n[run.tis]\ncap = 4.0\nlevel = "sequence"\n[up]\nrollout = "r.py:f"\n')
    run, _, _ = load_run_and_up(path, [])
    assert (run.tis_level, run.tis_cap) == ("sequence", 4.0)


@pytest.mark.parametrize(
    ("norm", "mode", "constant"),
    [(None, "sum", None), ("num_loss_tokens", "token-mean", None), ("num_sequences", "seq-mean-token-sum-norm", 1.0)],
)
def test_grad_accumulation_normalization_picks_the_same_objective(norm, mode, constant):
    import enum

    cfg = Config(grad_accumulation_normalization=norm)
    assert (cfg.loss_agg_mode, cfg.loss_agg_constant) == (mode, constant)

    class GradAccNormalization(str, enum.Enum):  # noqa: UP042 (the cookbook's enum, as it is written)
        NUM_LOSS_TOKENS = "num_loss_tokens"

    assert Config(grad_accumulation_normalization=GradAccNormalization.NUM_LOSS_TOKENS).loss_agg_mode == "token-mean"


def test_the_settings_fleetrl_always_behaves_as_are_accepted():
    cfg = Config(
        pipeline_chunks_per_step=4,
        anchor_logp="old_policy",
        save_final_checkpoint=True,
        cleanup_on_exit=True,
        router_replay=False,
        router_replay_completion_only=True,
        init_from_checkpoint=None,
        weight_sync_timeout=None,
    )
    assert cfg == Config()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pipeline_chunks_per_step": 0}, "pipeline_chunks_per_step must be an int >= 1"),
        ({"anchor_logp": "rollout"}, "anchor_logp='rollout': .*not implemented"),
        ({"router_replay": True}, "router_replay=True: MoE router replay"),
        ({"save_final_checkpoint": False}, "save_final_checkpoint=False: fleetrl always writes the final"),
        ({"cleanup_on_exit": False}, "cleanup_on_exit=False: fleetrl.main always stops"),
        ({"init_from_checkpoint": "step-10"}, "init_from_checkpoint: fleetrl resumes a run from its own log_path"),
        ({"weight_sync_timeout": 600}, "weight_sync_timeout=600: .*weight_push_timeout_s"),
        ({"grad_accumulation_normalization": "mean"}, "grad_accumulation_normalization must be None"),
        ({"grad_accumulation_normalization": None, "loss_agg_mode": "token-mean"}, "disagree"),
        ({"tis": {"cap": 0.0}}, r"tis.cap: 0 zeroes every token's weight"),
        ({"tis": {"levl": "token"}}, "tis.levl: not a field"),
        ({"min_group_size": 1}, "min_group_size: 1 would emit groups of one sample"),
    ],
)
def test_the_current_recipes_fields_fleetrl_cannot_honour_fail_naming_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        Config(**fields)
    with pytest.raises(ConfigError, match=message):
        Config.load(fields)


def test_the_cookbooks_config_takes_the_cookbooks_defaults():
    from fleetrl import cookbook

    cfg = cookbook.Config(log_path="runs/x", base_model="m")
    # async_rl_loop.Config and DEFAULT_ADAM (beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=0)
    assert (cfg.completions_per_prompt, cfg.max_completion_tokens, cfg.max_rows, cfg.prompt_groups_per_step) == (
        4,
        1024,
        100,
        1,
    )
    assert cfg.grad_clip_norm is None and cfg.loss_agg_mode == "sum"  # no clipping; gradients of the token sum
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay) == (0.9, 0.95, 1e-12, 0.01)
    assert (cfg.kl_beta, cfg.learning_rate, cfg.tis_level, cfg.tis_cap) == (0.001, 1e-5, "token", 5.0)
    assert cfg.stale_policy == "train" and cfg.max_head_offpolicy_versions == 0  # admission-only staleness bound
    assert cookbook.Config(lora_rank=8).lora_alpha == 32 and cookbook.Config().lora_alpha is None
    # eps_clip_high None is eps_clip there (a symmetric clip), the loss's default (0.2 for grpo) in fleetrl.
    assert (
        cookbook.Config(eps_clip=0.3).eps_clip_high,
        cookbook.Config(eps_clip=0.3, eps_clip_high=0.4).eps_clip_high,
    ) == (
        0.3,
        0.4,
    )
    # What the recipe passes wins, in the cookbook's spelling or fleetrl's.
    assert cookbook.Config(max_rows=7, grad_clip_norm=1.0).max_rows == 7
    assert cookbook.Config(loss_agg_mode="token-mean").loss_agg_mode == "token-mean"
    # The defaults are set values: they survive fleetrl.main's re-validation with its keyword arguments.
    again = Config.load({**cfg.model_dump(exclude_unset=True), "max_steps": 3})
    assert (again.max_rows, again.adam_beta2, again.loss_agg_mode) == (100, 0.95, "sum")
    assert Config().max_rows is None and Config().grad_clip_norm == 1.0  # fleetrl's own Config keeps its defaults
    assert cookbook.main is not None and callable(cookbook.main)


def test_the_cookbooks_main_does_not_cap_rows_handed_in(monkeypatch):
    # The cookbook's main() applies max_rows (default 100) to the dataset it loads, never to rows=; fleetrl.main
    # caps both, so the cookbook's main lifts the cap for rows= (else 512 rows would silently become 100).
    import fleetrl
    from fleetrl import cookbook

    calls = []
    monkeypatch.setattr(fleetrl, "main", lambda cfg, factory, rows, **options: calls.append((rows, options)))
    cfg = cookbook.Config(base_model="m")
    cookbook.main(cfg, rollout_fn_factory="r.py:f", rows=[{"id": 1}], rollout_extras={"max_turns": 2})
    cookbook.main(cfg, rollout_fn_factory="r.py:f")
    assert calls == [([{"id": 1}], {"rollout_extras": {"max_turns": 2}, "max_rows": None}), (None, {})]


def test_the_cookbooks_main_evaluates_every_step_unless_told(monkeypatch):
    # The cookbook's main(evaluation_fn=..., evaluation_interval=1): every step. fleetrl's evaluation_interval 0 is
    # start and end only, so the cookbook's main sets 1 when neither the call nor the config says.
    import fleetrl
    from fleetrl import cookbook

    calls = []
    monkeypatch.setattr(fleetrl, "main", lambda cfg, factory, rows, **options: calls.append(options))

    async def evaluation_fn(step, rollout_fn):
        return {}

    cookbook.main(cookbook.Config(), rollout_fn_factory="r.py:f", evaluation_fn=evaluation_fn)
    cookbook.main(cookbook.Config(), rollout_fn_factory="r.py:f", evaluation_fn=evaluation_fn, evaluation_interval=5)
    cookbook.main(cookbook.Config(evaluation_interval=2), rollout_fn_factory="r.py:f", evaluation_fn=evaluation_fn)
    assert [c.get("evaluation_interval") for c in calls] == [1, 5, None]
