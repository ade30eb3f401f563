"""The kernel swap-in path (fleetrl.trainer.kernels) leaves the model's outputs and gradients unchanged.

Liger's Triton kernels need a GPU, so on CPU the same swap-in code runs with the reference implementations of the
same interfaces (`TORCH_KERNELS`), wrapped to count their calls: a test fails if an op is not swapped in where it
should be (the counts) or if the swapped model computes anything else (outputs and gradients). Tolerance: 1e-5
absolute on logprobs and entropy, 1e-5 relative to the largest gradient entry (the fused head computes the logprob
as a cross-entropy of the tempered hidden states, the chunked head as logit minus logsumexp of tempered logits).
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from fleetrl.tiny_model import build_tiny_model
from fleetrl.trainer.kernels import TORCH_KERNELS, Kernels, choose_kernels, model_kernels, swap_in
from fleetrl.trainer.logprobs import pack, packed_logprobs, padded_logprobs
from fleetrl.trainer.model import ModelOptions, load_causal_lm, model_options
from tests.unit.trainer.helpers import make_cfg

LENGTHS = [6, 19, 3, 12]


@pytest.fixture(autouse=True)
def _restore_rotary(monkeypatch):
    """The RoPE swap replaces a module global (as Liger's own patching does): put the originals back afterwards."""
    for module in (modeling_qwen2, modeling_llama):
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=3, seed=5))


def _counting(kernels: Kernels, device_type: str | None = None) -> tuple[Kernels, collections.Counter]:
    calls: collections.Counter = collections.Counter()

    def wrap(name: str, fn):
        def counted(*args):
            calls[name] += 1
            return fn(*args)

        return counted

    ops = ("rms_norm", "swiglu", "rotary", "linear_logprobs")
    counted = replace(kernels, **{op: wrap(op, getattr(kernels, op)) for op in ops}, device_type=device_type)
    return counted, calls


def _packed():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 300, (n + 1,), generator=g).tolist() for n in LENGTHS]
    return pack([s[:-1] for s in seqs], [s[1:] for s in seqs])


def _run(model: torch.nn.Module, *, padded: bool = False):
    model.zero_grad(set_to_none=True)
    batch = _packed()
    if padded:
        ids, targets = batch.input_ids_1N[:, :36].view(2, 18), batch.targets_N[:36].view(2, 18)
        logprobs, entropy = padded_logprobs(model, ids, targets, temperature=0.7, chunk_tokens=8, entropy=True)
    else:
        logprobs, entropy = packed_logprobs(model, batch, temperature=0.7, chunk_tokens=8, entropy=True)
    (-(logprobs * torch.linspace(0.5, 1.5, logprobs.numel()).view(logprobs.shape)).mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


def _assert_same(a, b) -> None:
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = a, b
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    scale = max(g.abs().max() for g in grads_a.values())
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_swapped_in_kernels_run_everywhere_and_change_no_output_or_gradient(model_dir, padded):
    plain = _run(load_causal_lm(model_dir), padded=padded)
    kernels, calls = _counting(TORCH_KERNELS)
    model = load_causal_lm(model_dir, options=ModelOptions(kernels=kernels))
    layers = model.config.num_hidden_layers
    assert model_kernels(model) is kernels
    swapped = _run(model, padded=padded)
    _assert_same(plain, swapped)
    # One forward: two norms per layer and the final one, a SwiGLU and a RoPE per layer, one fused head.
    assert calls == {"rms_norm": 2 * layers + 1, "swiglu": layers, "rotary": layers, "linear_logprobs": 1}


def test_swap_in_reports_what_it_swapped(model_dir):
    model = load_causal_lm(model_dir)
    layers = model.config.num_hidden_layers
    assert swap_in(model, TORCH_KERNELS) == {
        "rms_norm": 2 * layers + 1,
        "swiglu": layers,
        "rotary": 1,
        "linear_logprobs": 1,
    }
    assert dict(model.state_dict()).keys() == dict(load_causal_lm(model_dir).state_dict()).keys()


def test_kernels_for_another_device_leave_this_ones_modules_alone(model_dir):
    """Liger's kernels are for CUDA tensors: a CPU model in the same process (the RoPE swap is process-wide) keeps
    HF's own RoPE; the instance ops are swapped only into the model they were given."""
    kernels, calls = _counting(TORCH_KERNELS, device_type="cuda")
    load_causal_lm(model_dir, options=ModelOptions(kernels=kernels))  # swaps the modeling module's RoPE
    other = load_causal_lm(model_dir)
    plain = _run(load_causal_lm(model_dir))
    _assert_same(plain, _run(other))
    assert calls == {}


def test_checkpointing_and_kernels_together_keep_the_gradients(model_dir):
    from fleetrl.trainer.layers import CheckpointPlan

    plain = _run(load_causal_lm(model_dir))
    kernels, calls = _counting(TORCH_KERNELS)
    options = ModelOptions(checkpointing=CheckpointPlan(1, "mlp"), kernels=kernels)
    _assert_same(plain, _run(load_causal_lm(model_dir, options=options)))
    assert calls["swiglu"] == 2 * 3  # each MLP recomputed in backward, through the swapped SwiGLU


def test_liger_is_chosen_only_on_cuda_with_the_package():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_kernels("auto", cpu) is None
    assert choose_kernels(False, cuda) is None
    with pytest.raises(ValueError, match=r"liger_kernels = true: .* need a CUDA device"):
        choose_kernels(True, cpu)
    with pytest.raises(ValueError, match="liger_kernels must be"):
        choose_kernels("yes", cpu)


def test_liger_true_without_the_package_fails_naming_the_field(monkeypatch):
    import fleetrl.trainer.kernels as kernels_module

    monkeypatch.setattr(kernels_module, "liger_available", lambda: False)
    assert choose_kernels("auto", torch.device("cuda")) is None
    with pytest.raises(ValueError, match=r"liger_kernels = true: liger-kernel is not installed"):
        choose_kernels(True, torch.device("cuda"))


def test_a_cpu_trainer_with_liger_kernels_true_fails_at_start(tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, liger_kernels=True)
    with pytest.raises(ValueError, match="liger_kernels"):
        model_options(cfg, torch.device("cpu"))
