"""Mixed precision (bfloat16 compute over float32 weights) keeps an RL-sized update that pure bfloat16 loses, and
activation checkpointing follows the micro-batch's length when set to auto."""

from __future__ import annotations

import pytest
import torch

from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer import inner_loop as inner_loop_module
from fleetrl.trainer.inner_loop import resolve_compute_dtype
from tests.unit.trainer.helpers import make_cfg, tiny_groups


def _changed_fraction(trainer: PolicyTrainer, groups) -> float:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(groups)
    changed = total = 0
    for n, p in trainer.model.named_parameters():
        changed += int((p.detach() != before[n]).sum())
        total += p.numel()
    return changed / total


def test_an_lr_1e6_update_changes_the_weights_under_mixed_precision_and_is_lost_in_pure_bf16(tiny_model_dir, tmp_path):
    groups = tiny_groups(tiny_model_dir, num_groups=2, group_size=4)
    common = {"learning_rate": 1e-6, "grad_clip_norm": None}
    mixed = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "mixed", compute_dtype="bfloat16", **common))
    seen: list[torch.dtype] = []
    layer = mixed.model.model.layers[0].mlp.down_proj
    hook = layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    mixed_changed = _changed_fraction(mixed, groups)
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)  # the forward ran in bfloat16 ...
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())  # ... over float32 master weights
    state = next(iter(mixed.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    pure = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "pure", dtype="bfloat16", **common))
    pure_changed = _changed_fraction(pure, groups)
    print(f"weights changed by one lr-1e-6 step: mixed {mixed_changed:.3f}, pure bf16 {pure_changed:.3f}")
    assert mixed_changed > 0.5  # (embedding rows of tokens absent from the batch get no gradient)
    assert pure_changed < 0.05
    mixed.close()
    pure.close()


def test_compute_dtype_auto_is_bf16_on_cuda_and_the_weights_dtype_on_cpu(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path)
    assert cfg.compute_dtype == "auto"
    assert resolve_compute_dtype(cfg, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_compute_dtype(cfg, torch.device("cpu")) == torch.float32
    assert resolve_compute_dtype(make_cfg(tiny_model_dir, tmp_path, dtype="bfloat16"), torch.device("cpu")) == (
        torch.bfloat16
    )
    assert resolve_compute_dtype(make_cfg(tiny_model_dir, tmp_path, compute_dtype="float32"), torch.device("cuda")) == (
        torch.float32
    )


def test_auto_activation_checkpointing_is_on_for_long_micro_batches_only(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(inner_loop_module, "AUTO_CHECKPOINT_TOKENS", 40)
    groups = tiny_groups(tiny_model_dir, num_groups=2, group_size=4)
    cfg = make_cfg(tiny_model_dir, tmp_path, micro_batch_tokens=45)
    assert cfg.gradient_checkpointing == "auto"
    trainer = PolicyTrainer(cfg)
    layer = trainer.model.model.layers[0]
    seen: list[tuple[int, bool]] = []

    def record(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden.shape[1], layer.gradient_checkpointing))

    hook = layer.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train_step(groups)
    hook.remove()
    assert seen and all(on == (tokens >= 40) for tokens, on in seen), seen
    assert {on for _, on in seen} == {True, False}  # the step had both kinds
    trainer.close()


@pytest.mark.parametrize("setting", [True, False])
def test_activation_checkpointing_on_or_off_when_set(tiny_model_dir, tmp_path, setting):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, gradient_checkpointing=setting))
    trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2, group_size=4))
    assert trainer.model.model.layers[0].gradient_checkpointing is setting
    trainer.close()
