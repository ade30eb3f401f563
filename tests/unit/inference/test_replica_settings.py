"""services/inference/replica_settings.py: a replica's device defaults and the start-up KV check (pure logic)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.services.inference.replica_settings import (
    GIB,
    KVShape,
    ReplicaSettingsError,
    check_kv_fits,
    checkpoint_parameters,
    engine_settings,
)

LLAMA_8B = KVShape(layers=32, kv_heads=8, head_dim=128)  # Llama-3-8B: 128 KiB of KV per token in bfloat16


def test_on_a_gpu_the_kv_cache_is_sized_from_a_memory_share_bf16_and_cuda_graphs() -> None:
    s = engine_settings(on_gpu=True)
    assert (s.dtype, s.enforce_eager, s.kv_cache_bytes, s.gpu_memory_utilization) == ("bfloat16", False, None, 0.9)
    assert s.kv_cache_setting == "gpu_memory_utilization"
    s = engine_settings(on_gpu=True, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.5)
    assert (s.dtype, s.enforce_eager, s.gpu_memory_utilization) == ("float32", True, 0.5)
    s = engine_settings(on_gpu=True, kv_cache_gib=20)  # a fixed size only where asked
    assert (s.kv_cache_bytes, s.kv_cache_setting) == (20 * GIB, "kv_cache_gib")


def test_on_cpu_the_kv_cache_is_a_fixed_size_float32_and_eager() -> None:
    s = engine_settings(on_gpu=False)
    assert (s.dtype, s.enforce_eager, s.kv_cache_bytes, s.gpu_memory_utilization) == ("float32", True, GIB, None)
    s = engine_settings(on_gpu=False, environ={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert (s.kv_cache_bytes, s.kv_cache_setting) == (4 * GIB, "VLLM_CPU_KVCACHE_SPACE")
    s = engine_settings(on_gpu=False, kv_cache_gib=0.5, environ={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert (s.kv_cache_bytes, s.kv_cache_setting) == (GIB // 2, "kv_cache_gib")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_cache_gib": 0.0}, "kv_cache_gib"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"environ": {"VLLM_CPU_KVCACHE_SPACE": "lots"}}, "VLLM_CPU_KVCACHE_SPACE"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ReplicaSettingsError, match=field):
        engine_settings(on_gpu=False, **kwargs)


def test_a_fixed_kv_cache_too_small_for_one_sequence_is_refused_naming_the_setting() -> None:
    # The setting this issue replaced: 1 GiB on any device holds 8192 tokens of an 8B model, not its 128k context.
    settings = engine_settings(on_gpu=True, kv_cache_gib=1.0)
    with pytest.raises(ReplicaSettingsError, match=r"kv_cache_gib = 1 GiB .* holds 8192 tokens") as refusal:
        check_kv_fits(LLAMA_8B, max_model_len=131072, dtype="bfloat16", settings=settings)
    assert "raise kv_cache_gib to at least 16" in str(refusal.value)
    assert "cap max_model_len at 8192" in str(refusal.value)
    check_kv_fits(LLAMA_8B, max_model_len=8192, dtype="bfloat16", settings=settings)  # exactly fits
    cpu = engine_settings(on_gpu=False, environ={"VLLM_CPU_KVCACHE_SPACE": "1"})
    with pytest.raises(ReplicaSettingsError, match="raise VLLM_CPU_KVCACHE_SPACE"):
        check_kv_fits(LLAMA_8B, max_model_len=8193, dtype="bfloat16", settings=cpu)


def test_a_gpu_share_too_small_for_one_sequence_is_refused_naming_the_settings() -> None:
    settings = engine_settings(on_gpu=True)
    weights = 16 * 10**9  # 8B parameters in bfloat16
    # An 80 GB card: 0.9 x 80 GB less 16 GB of weights holds the 128k context several times over.
    check_kv_fits(
        LLAMA_8B,
        max_model_len=131072,
        dtype="bfloat16",
        settings=settings,
        device_bytes=80 * 10**9,
        weight_bytes=weights,
    )
    with pytest.raises(ReplicaSettingsError) as refusal:  # a 24 GB card does not
        check_kv_fits(
            LLAMA_8B,
            max_model_len=131072,
            dtype="bfloat16",
            settings=settings,
            device_bytes=24 * 10**9,
            weight_bytes=weights,
        )
    message = str(refusal.value)
    assert "raise gpu_memory_utilization" in message and "cap max_model_len at 42724" in message
    assert "tensor_parallel_size" in message
    # Two ranks: half the KV heads and half the weights each.
    half = KVShape(layers=32, kv_heads=4, head_dim=128)
    check_kv_fits(
        half,
        max_model_len=131072,
        dtype="bfloat16",
        settings=settings,
        device_bytes=24 * 10**9,
        weight_bytes=weights // 2,
    )


def test_checkpoint_parameters_counts_the_safetensors_elements(tiny_model_dir: str) -> None:
    state = load_file(f"{tiny_model_dir}/model.safetensors")
    assert checkpoint_parameters(tiny_model_dir) == sum(math.prod(t.shape) for t in state.values()) > 0
    assert all(isinstance(t, torch.Tensor) for t in state.values())
