"""The vLLM worker extension's pure checks (no vLLM needed): the expected weight spec and manifest checks.

These run without vLLM installed: vllm_worker.py imports vLLM nowhere, only the worker process it is mixed
into has it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from fleetrl.clients.inference_types import WeightLoadError
from fleetrl.services.inference.vllm_worker import (
    _spec_from_checkpoint,
    check_manifest,
    expected_weight_spec,
)
from fleetrl.weights import build_manifest


def test_spec_matches_the_checkpoint_and_uses_the_served_dtype(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    spec = expected_weight_spec(config, "bfloat16", tiny_model_dir)
    from_headers = _spec_from_checkpoint(__import__("pathlib").Path(tiny_model_dir), "bfloat16")
    assert spec.tensors == from_headers.tensors
    assert {dtype for _, dtype in spec.tensors.values()} == {"bfloat16"}
    assert spec.optional == frozenset()


def test_tied_embeddings_make_lm_head_an_optional_alias(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    spec = expected_weight_spec(config, "float32", tiny_model_dir)
    assert spec.optional == frozenset({"lm_head.weight"})
    assert "model.embed_tokens.weight" in spec.tensors


def test_unbuildable_config_falls_back_to_checkpoint_headers(tiny_model_dir):
    class Unknown:  # transformers cannot build this "config"
        pass

    spec = expected_weight_spec(Unknown(), "float32", tiny_model_dir)
    assert "model.embed_tokens.weight" in spec.tensors
    with pytest.raises(RuntimeError, match="expected weights"):
        expected_weight_spec(Unknown(), "float32", None)


def _state(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(f"{tiny_model_dir}/model.safetensors")


def test_check_manifest_accepts_the_model_and_names_each_problem(tiny_model_dir):
    spec = expected_weight_spec(AutoConfig.from_pretrained(tiny_model_dir), "float32")
    state = _state(tiny_model_dir)
    check_manifest(build_manifest(3, state), 3, spec)
    with pytest.raises(WeightLoadError, match="asked for weights version 4"):
        check_manifest(build_manifest(3, state), 4, spec)
    name = "model.layers.1.mlp.down_proj.weight"
    cases = {
        "unknown": {**state, "model.extra.weight": torch.zeros(2)},
        "missing": {k: v for k, v in state.items() if k != name},
        "shape": {**state, name: torch.zeros(2, 2)},
        "dtype": {**state, name: state[name].to(torch.bfloat16)},
    }
    for word, bad in cases.items():
        with pytest.raises(WeightLoadError, match=word):
            check_manifest(build_manifest(3, bad), 3, spec)


def test_check_manifest_refuses_an_adapter_naming_the_flag(tiny_model_dir):
    """With LoRA off the worker gets every version; an adapter is refused with the way to serve it."""
    spec = expected_weight_spec(AutoConfig.from_pretrained(tiny_model_dir), "float32")
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(WeightLoadError, match=r"is a LoRA adapter .* --max-lora-rank"):
        check_manifest(build_manifest(3, adapter, adapter=config), 3, spec)
