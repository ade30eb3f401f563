"""A LoRA version on the real weight stream carries the adapter's tensors only (PEFT on the tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.weights import WeightPublisher, fetch_weights

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_push_carries_only_the_adapter(tiny_model_dir: str, tmp_path, dtype: torch.dtype) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    # autocast_adapter_dtype=False: the adapter in the trainer's dtype (PEFT would otherwise keep it in float32).
    model = peft.get_peft_model(base, lora, autocast_adapter_dtype=False)
    state = peft.get_peft_model_state_dict(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with WeightPublisher() as publisher:
        published = publisher.publish(1, state, adapter=config)
        manifest, tensors = fetch_weights(publisher.address, 1, timeout_s=30)
    assert manifest.is_adapter and manifest.adapter == config and manifest.checksum == published.checksum
    assert set(manifest.names) == set(state) and all(".lora_" in name for name in manifest.names)
    assert manifest.total_bytes == adapter_params * dtype.itemsize < full_bytes / 10
    assert all(tensors[name].dtype == dtype and tensors[name].equal(state[name]) for name in state)
