"""Selective activation checkpointing and per-layer compile leave losses and gradients unchanged.

Checkpointing recomputes the same ops on the same inputs, so losses and gradients must equal the plain run's to
float32 rounding (1e-6 relative to the largest gradient entry). What is recomputed is asserted by counting the
forwards of each layer and sublayer in one forward/backward: a checkpointed one runs twice, the others once.
`torch.compile` (inductor's CPU code) may fuse and reorder float32 reductions: 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch

from fleetrl.tiny_model import build_tiny_model
from fleetrl.trainer.layers import CheckpointPlan, decoder_layers, set_checkpointing
from fleetrl.trainer.logprobs import pack, packed_logprobs, padded_logprobs
from fleetrl.trainer.model import ModelOptions, load_causal_lm, model_options

LENGTHS = [5, 17, 3, 30]


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("four_layers"), num_layers=4, seed=3))


def _packed(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 300, (n + 1,), generator=g).tolist() for n in LENGTHS]
    return pack([s[:-1] for s in seqs], [s[1:] for s in seqs])


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs_N, _ = packed_logprobs(model, _packed(), temperature=0.8, chunk_tokens=16)
    loss = -(logprobs_N * torch.linspace(0.5, 1.5, logprobs_N.numel())).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, rel: float) -> None:
    loss_a, grads_a = a
    loss_b, grads_b = b
    assert torch.allclose(loss_a, loss_b, rtol=rel, atol=0), (loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    scale = max(g.abs().max() for g in grads_a.values())
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max() <= rel * scale, name


def _count_forwards(model: torch.nn.Module, sub: str | None) -> list[int]:
    """Per decoder layer, how many times its module (or its `sub` module) runs a forward. A checkpointed sublayer's
    recomputation calls its forward directly, so `sub` names a module inside it (its first projection)."""
    counts = [0] * len(decoder_layers(model))
    for i, layer in enumerate(decoder_layers(model)):
        target = layer if sub is None else layer.get_submodule(sub)

        def hook(*_args, i=i) -> None:
            counts[i] += 1

        target.register_forward_pre_hook(hook)
    return counts


@pytest.mark.parametrize(
    ("every", "scope", "sub", "recomputed"),
    [
        (1, "layer", None, [2, 2, 2, 2]),
        (2, "layer", None, [2, 1, 2, 1]),
        (3, "layer", None, [2, 1, 1, 2]),
        (1, "attention", "self_attn.q_proj", [2, 2, 2, 2]),
        (2, "attention", "self_attn.q_proj", [2, 1, 2, 1]),
        (1, "mlp", "mlp.gate_proj", [2, 2, 2, 2]),
    ],
)
def test_selective_checkpointing_recomputes_what_it_says_and_keeps_the_gradients(
    four_layer_dir, every, scope, sub, recomputed
):
    plain = _loss_and_grads(load_causal_lm(four_layer_dir))
    model = load_causal_lm(four_layer_dir, options=ModelOptions(checkpointing=CheckpointPlan(every, scope)))
    counts = _count_forwards(model, sub)
    result = _loss_and_grads(model)
    assert counts == recomputed
    _assert_same(plain, result, 1e-6)
    # Switched off (gradient_checkpointing = "auto" on a short micro-batch): every module runs once.
    assert set_checkpointing(model, False) == 0
    counts[:] = [0] * len(counts)
    _assert_same(plain, _loss_and_grads(model), 1e-6)
    assert counts == [1, 1, 1, 1]
    assert set_checkpointing(model, True) == sum(c == 2 for c in recomputed)


def test_the_sublayer_scope_leaves_the_whole_layer_unchecked(four_layer_dir):
    model = load_causal_lm(four_layer_dir, options=ModelOptions(checkpointing=CheckpointPlan(1, "attention")))
    layer_counts = _count_forwards(model, None)
    mlp_counts = _count_forwards(model, "mlp.gate_proj")
    _loss_and_grads(model)
    assert layer_counts == [1, 1, 1, 1] and mlp_counts == [1, 1, 1, 1]


def test_the_run_config_gives_the_plan(tiny_model_dir, tmp_path):
    from tests.unit.trainer.helpers import make_cfg

    cfg = make_cfg(
        tiny_model_dir,
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_every=2,
        gradient_checkpointing_scope="mlp",
    )
    options = model_options(cfg, torch.device("cpu"))
    assert options.checkpointing == CheckpointPlan(2, "mlp")
    assert options.kernels is None and not options.compile_layers  # auto: no Liger on CPU
    assert model_options(make_cfg(tiny_model_dir, tmp_path, gradient_checkpointing=False), torch.device("cpu")) == (
        ModelOptions()
    )


@pytest.mark.parametrize(
    ("every", "scope", "field"), [(0, "layer", "gradient_checkpointing_every"), (1, "ffn", "scope")]
)
def test_a_bad_plan_is_refused_naming_the_field(every, scope, field):
    with pytest.raises(ValueError, match=field):
        CheckpointPlan(every, scope)  # type: ignore[arg-type]


@pytest.mark.slow  # inductor compiles the layer's forward and backward: about a minute on a 2-core CPU
def test_compiled_layers_give_the_eager_loss_and_gradients(tiny_model_dir):
    torch._dynamo.reset()
    eager = load_causal_lm(tiny_model_dir)
    compiled = load_causal_lm(tiny_model_dir, options=ModelOptions(compile_layers=True))
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(compiled))
    packed = _packed()
    ids_BT, targets_BT = packed.input_ids_1N[:, :54].view(2, 27), packed.targets_N[:54].view(2, 27)

    def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logprobs_BT, _ = padded_logprobs(model, ids_BT, targets_BT, temperature=0.8, chunk_tokens=16)
        loss = -logprobs_BT.mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _assert_same(loss_and_grads(eager), loss_and_grads(compiled), 1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > calls  # the layers did run compiled


def test_the_trainer_trains_with_the_configured_plan(tiny_model_dir, tmp_path):
    """The run config's plan reaches the trainer's model, and its step recomputes what the plan says (the tiny
    model's 2 layers, every 2nd: layer 0's MLP only)."""
    from fleetrl.trainer import PolicyTrainer
    from tests.unit.trainer.helpers import make_cfg, tiny_groups

    cfg = make_cfg(
        tiny_model_dir,
        tmp_path,
        gradient_checkpointing=True,
        gradient_checkpointing_every=2,
        gradient_checkpointing_scope="mlp",
    )
    trainer = PolicyTrainer(cfg)
    counts = _count_forwards(trainer.model, "mlp.gate_proj")
    result = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2, group_size=4))
    assert torch.isfinite(torch.tensor(result.metrics["train/loss"]))
    # Layer 1's MLP runs once per forward; layer 0's once more per backward (its recomputation).
    assert counts[1] >= 1 and counts[0] > counts[1]
