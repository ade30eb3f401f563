"""LoRA adapter checks (services/inference/lora.py) on hand-written specs, and the --max-lora-rank plumbing."""

from __future__ import annotations

import math

import pytest

from fleetrl.clients.inference_types import WeightLoadError
from fleetrl.config import Config
from fleetrl.services.inference.config import InferenceConfig, InferenceConfigError
from fleetrl.services.inference.launcher import build_parser, config_from_args
from fleetrl.services.inference.lora import plan_adapter
from fleetrl.services.inference.vllm_engine import vllm_lora_rank
from fleetrl.up.run import lora_flags

MODEL = {
    "model.embed_tokens.weight": ((100, 64), "float32"),
    "model.layers.0.self_attn.q_proj.weight": ((64, 64), "float32"),
    "model.layers.0.self_attn.v_proj.weight": ((32, 64), "float32"),
    "model.layers.0.input_layernorm.weight": ((64,), "float32"),
}
Q = "base_model.model.model.layers.0.self_attn.q_proj"
V = "base_model.model.model.layers.0.self_attn.v_proj"


def adapter(r: int = 4, dtype: str = "float32") -> dict:
    return {
        f"{Q}.lora_A.weight": ((r, 64), dtype),
        f"{Q}.lora_B.weight": ((64, r), dtype),
        f"{V}.lora_A.weight": ((r, 64), dtype),
        f"{V}.lora_B.weight": ((32, r), dtype),
    }


def config(r: int = 4, **extra) -> dict:
    return {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **extra}


def test_a_fitting_adapter_is_planned_layer_by_layer() -> None:
    plan = plan_adapter(config(), adapter(dtype="bfloat16"), MODEL, max_rank=8)
    assert plan.rank == 4 and plan.scaling == 2.0
    assert [(a.weight, a.lora_a, a.lora_b) for a in plan.layers] == [
        ("model.layers.0.self_attn.q_proj.weight", f"{Q}.lora_A.weight", f"{Q}.lora_B.weight"),
        ("model.layers.0.self_attn.v_proj.weight", f"{V}.lora_A.weight", f"{V}.lora_B.weight"),
    ]
    rs = plan_adapter(config(use_rslora=True), adapter(), MODEL, max_rank=8)
    assert rs.scaling == pytest.approx(8 / math.sqrt(4))
    # Full module names (what PEFT writes for "all-linear") and a regex match too.
    full = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    plan_adapter(config(target_modules=full), adapter(), MODEL, max_rank=8)
    plan_adapter(config(target_modules=r".*\.(q|v)_proj"), adapter(), MODEL, max_rank=8)


@pytest.mark.parametrize(
    ("cfg", "tensors", "max_rank", "message"),
    [
        (config(), adapter(), 0, "--max-lora-rank"),
        (config(r=16), adapter(r=16), 8, "r=16 exceeds this replica's --max-lora-rank 8"),
        (config(target_modules=["q_proj", "foo_proj"]), adapter(), 8, "unknown target modules ['foo_proj']"),
        (config(target_modules="nothing.*"), adapter(), 8, "matches no linear layer"),
        (config(), {**adapter(), f"{Q[:-6]}foo_proj.lora_A.weight": ((4, 64), "float32")}, 8, "no linear layer"),
        (config(), {**adapter(), f"{Q}.lora_A.weight": ((4, 32), "float32")}, 8, "shape [4, 32] != [4, 64]"),
        (config(r=2), adapter(r=4), 8, "shape [4, 64] != [2, 64]"),
        (config(), {k: v for k, v in adapter().items() if k != f"{V}.lora_B.weight"}, 8, "lora_B is missing"),
        (config(), {**adapter(), f"{Q}.lora_magnitude_vector": ((64,), "float32")}, 8, "not a LoRA tensor"),
        (config(), adapter(dtype="int8"), 8, "not a floating type"),
        (config(use_dora=True), adapter(), 8, "DoRA"),
        (config(modules_to_save=["lm_head"]), adapter(), 8, "modules_to_save"),
        (config(bias="all"), adapter(), 8, "bias='all'"),
        (config(peft_type="IA3"), adapter(), 8, "'IA3' is not supported"),
        (config(r=0), adapter(), 8, "r must be a positive int"),
        ({"r": 4, "target_modules": ["q_proj"]}, adapter(), 8, "lora_alpha must be a positive number"),
        (config(), {}, 8, "no LoRA tensors"),
        (None, adapter(), 8, "full model"),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_problem(cfg, tensors, max_rank, message) -> None:
    with pytest.raises(WeightLoadError) as err:
        plan_adapter(cfg, tensors, MODEL, max_rank=max_rank)
    assert message in str(err.value)


def test_vllm_lora_rank_rounds_up_to_a_rank_vllm_serves() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 512)] == [1, 8, 8, 16, 16, 32, 512]
    with pytest.raises(ValueError, match="513"):
        vllm_lora_rank(513)


def test_max_lora_rank_flag_and_its_bounds() -> None:
    args = build_parser().parse_args(["--model", "/m", "--max-lora-rank", "16"])
    assert config_from_args(args).max_lora_rank == 16
    assert InferenceConfig(model="/m").max_lora_rank == 0
    with pytest.raises(InferenceConfigError, match="max_lora_rank"):
        InferenceConfig.build({"model": "/m", "max_lora_rank": -1})
    with pytest.raises(InferenceConfigError, match="max_lora_rank: vLLM serves LoRA ranks up to 512"):
        InferenceConfig.build({"model": "/m", "max_lora_rank": 1024})
    assert InferenceConfig.build({"model": "/m", "engine": "hf", "max_lora_rank": 1024}).max_lora_rank == 1024


def test_fleetrl_up_starts_replicas_with_the_runs_lora_rank() -> None:
    assert lora_flags(Config.load({}, source="test")) == []
    flags = lora_flags(Config.load({"lora_rank": 8}, source="test"))
    assert flags == ["--max-lora-rank", "8"]
    assert config_from_args(build_parser().parse_args(["--model", "/m", *flags])).max_lora_rank == 8
