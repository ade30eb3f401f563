"""LoRA adapter versions on the hf engine (lora_checks.py): applied on the base, checked, refused when bad."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.weights import WeightPublisher
from tests.integration.inference import lora_checks

pytestmark = pytest.mark.integration

MAX_RANK = 16


@pytest.fixture
async def engine(tiny_model_dir: str):
    engine = HFEngine(tiny_model_dir, max_num_seqs=16, max_lora_rank=MAX_RANK)
    await engine.start()
    yield engine
    await engine.shutdown()


async def test_adapter_changes_generation_and_logprobs_match_the_trainer(engine, tiny_model_dir):
    worst = await lora_checks.check_adapter_changes_generation_and_matches_trainer(engine, tiny_model_dir)
    assert worst < 1e-3


async def test_second_adapter_applies_to_the_base_not_on_top(engine, tiny_model_dir):
    await lora_checks.check_second_adapter_applies_to_the_base(engine, tiny_model_dir)


async def test_bad_adapters_are_refused_and_the_old_version_serves(engine, tiny_model_dir):
    await lora_checks.check_bad_adapters_refused(engine, tiny_model_dir, MAX_RANK)


async def test_adapter_versions_leave_the_base_weights_exact(engine, tiny_model_dir):
    base = {k: v.clone() for k, v in engine._state.items()}
    with WeightPublisher() as publisher:
        for i in range(3):
            adapter = lora_checks.make_adapter(tiny_model_dir, seed=10 + i)
            await lora_checks.publish_and_load(engine, publisher, engine.loaded_version + 1, adapter)
    assert any(not engine._state[k].equal(base[k]) for k in base)  # an adapter is applied ...
    assert all(engine._lora_base[k].equal(base[k]) for k in engine._lora_base)  # ... on base copies that never drift
    await lora_checks.restore_base(engine, tiny_model_dir)
    assert all(engine._state[k].equal(base[k]) for k in base)


async def test_an_engine_without_max_lora_rank_refuses_adapters(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    await engine.start()
    try:
        adapter = lora_checks.make_adapter(tiny_model_dir, seed=1)
        with WeightPublisher() as publisher, pytest.raises(Exception, match="--max-lora-rank"):
            await lora_checks.publish_and_load(engine, publisher, 1, adapter)
        assert engine.loaded_version == 0
    finally:
        await engine.shutdown()
