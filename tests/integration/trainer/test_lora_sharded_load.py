"""A LoRA run loads through the meta-device sharded loader (issue 40): two gloo ranks wrap the model in its adapter
while it is on meta, shard it, and fill their own rows of the base weights (from the checkpoint) and of the adapter
(a new adapter's seeded init, or a warm-start adapter's file). Every weight, base and adapter, then equals the plain
whole load's exactly, and so do the logprobs with the adapter on and off. Peak memory per rank:
bench/lora_sharded_load.py (docs/benchmarks.md), not a timed or sized test."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from fleetrl.trainer import lora
from fleetrl.trainer.distributed import destroy, full_state_dict, shard_model
from fleetrl.trainer.model import load_causal_lm, target_logprobs
from fleetrl.trainer.sharded_load import load_sharded_causal_lm
from tests.integration.trainer.rank_env import end_rank, rank_context
from tests.unit.trainer.helpers import make_cfg

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD = 2


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _logprobs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inputs, targets = _batch(model.config.vocab_size)
    with torch.no_grad():
        on, _ = target_logprobs(model, inputs, targets)
        with model.disable_adapter():
            off, _ = target_logprobs(model, inputs, targets)
    return {"adapter": on, "base": off}


def _worker(rank: int, port: int, model_dir: str, log_path: str, adapter: str | None, out: str) -> None:
    ctx = rank_context(rank, WORLD, port)
    try:
        cfg = make_cfg(model_dir, Path(log_path), lora_rank=4, warm_start_from_adapter=adapter)
        model = load_sharded_causal_lm(
            model_dir,
            partial(shard_model, device=torch.device("cpu"), world_size=WORLD),
            wrap=partial(lora.wrap_with_lora, cfg=cfg),
            start_tensors=partial(lora.adapter_start_tensors, cfg=cfg),
        )
        assert all(hasattr(p, "to_local") for p in model.parameters())  # every weight, the adapter's too, sharded
        state = full_state_dict(model, ctx)
        logprobs = _logprobs(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/state.safetensors")
            torch.save(logprobs, f"{out}/logprobs.pt")
    finally:
        destroy(ctx)
    end_rank()


def _trained_adapter(model_dir: str, cfg, out: Path) -> str:
    """An adapter folder as PEFT saves it, with a non-zero B (so the adapter changes the logprobs)."""
    model = lora.wrap_with_lora(load_causal_lm(model_dir), cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    from fleetrl.trainer.distributed import DistContext

    lora.save_adapter(out, lora.adapter_state_dict(model, DistContext()), lora.adapter_config_json(model))
    return str(out)


@pytest.mark.parametrize("start", ["new adapter", "warm start"])
def test_two_ranks_load_a_lora_model_sharded_to_exactly_the_whole_load(tiny_model_dir, tmp_path, free_port, start):
    cfg = make_cfg(tiny_model_dir, tmp_path, lora_rank=4)
    adapter = _trained_adapter(tiny_model_dir, cfg, tmp_path / "adapter") if start == "warm start" else None
    mp.spawn(_worker, args=(free_port, tiny_model_dir, str(tmp_path), adapter, str(tmp_path)), nprocs=WORLD, join=True)

    plain_cfg = make_cfg(tiny_model_dir, tmp_path, lora_rank=4, warm_start_from_adapter=adapter)
    plain = lora.wrap_with_lora(load_causal_lm(tiny_model_dir), plain_cfg)
    expected = plain.state_dict()
    sharded = load_file(tmp_path / "state.safetensors")
    assert set(sharded) == set(expected)
    assert any("lora_A" in name for name in expected) and any("lora_B" in name for name in expected)
    for name, value in expected.items():
        torch.testing.assert_close(sharded[name], value, atol=0, rtol=0, msg=name)
    got, want = torch.load(tmp_path / "logprobs.pt"), _logprobs(plain)
    for which in ("adapter", "base"):
        torch.testing.assert_close(got[which], want[which], atol=1e-6, rtol=0, msg=which)
    if start == "warm start":  # the adapter is really in use: it moves the logprobs away from the base's
        assert (want["adapter"] - want["base"]).abs().max() > 1e-3
