"""Which attention path a packed row takes on which device, and that every path computes the same attention.

The rule (fleetrl.trainer.varlen_attention.choose_packed_attention) is measured by bench/trainer_packing.py paths and
explained in docs/trainer.md: on CPU one sdpa call per length bucket, never one per sample (a row of 128 short
samples ran 128 calls per layer, forward and backward).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fleetrl.trainer import varlen_attention as va
from fleetrl.trainer.logprobs import pack, packed_logprobs
from fleetrl.trainer.model import load_causal_lm, target_logprobs


def test_the_rule_on_cpu_is_one_call_per_length_bucket_whatever_the_samples():
    for samples in (1, 2, 8, 128, 4096):
        assert va.choose_packed_attention("cpu", samples, kernel=False) == va.BUCKETED


def test_the_rule_on_cuda_keeps_the_kernel_and_the_measured_loop():
    assert va.choose_packed_attention("cuda", 32, kernel=True) == va.VARLEN_KERNEL
    assert va.choose_packed_attention("cuda", 4, kernel=False) == va.SAMPLE_LOOP  # few long samples: H100 numbers


def test_a_length_bucket_pads_a_sample_to_less_than_twice_its_length():
    assert [va._bucket_of(n) for n in (1, 2, 3, 4, 5, 15, 16, 17, 4096)] == [1, 2, 4, 4, 8, 16, 16, 32, 4096]


def test_forcing_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="must be one of"), va.forced_path("per_token"):
        pass


def _qkv(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return tuple(torch.randn(1, h, n, dim, generator=g).requires_grad_(True) for h in (heads, kv_heads, kv_heads))


def _each_sample_alone(q, k, v, lengths):
    """The reference: every sample its own causal attention, `[1, N, heads, D]`."""
    bounds = [0, *itertools.accumulate(lengths)]
    out = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=True)
        for s, e in itertools.pairwise(bounds)
    ]
    return torch.cat(out, dim=2).transpose(1, 2)


# Many short samples in one bucket; a long tail across buckets out of row order (a bucket of one sample is a slice,
# the others gathered, and the outputs put back in row order); one sample.
ROWS = [[9, 12, 7, 15, 11, 10, 13, 8] * 4, [30, 3, 17, 5, 64, 9, 1, 17, 2], [21]]


@pytest.mark.parametrize("path", [va.SAMPLE_LOOP, va.BUCKETED, va.BLOCK_MASK])
@pytest.mark.parametrize("lengths", ROWS, ids=["short", "long-tail", "one"])
def test_every_path_gives_each_samples_own_attention_and_gradients(path, lengths):
    q, k, v = _qkv(lengths)
    bounds = pack([[1] * n for n in lengths], [[1] * n for n in lengths]).attention_bounds()
    with va.forced_path(path):
        out, _ = va.varlen_sdpa(torch.nn.Module(), q, k, v, None, **bounds)
    expected = _each_sample_alone(q, k, v, lengths)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _CountSdpa:
    """Counts torch's sdpa calls while installed (transformers' sdpa and varlen_sdpa both call it through F)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(F, "scaled_dot_product_attention", counted)


def test_a_packed_row_of_many_short_samples_runs_one_attention_call_per_layer_on_cpu(tiny_model_dir, monkeypatch):
    """The defect this guards: on CPU a packed row ran one sdpa call per sample per layer (128 short samples: 128
    calls a layer forward, Python dispatch dominating a tiny model's step)."""
    model = load_causal_lm(tiny_model_dir)
    assert va.use_packed_attention(model, torch.device("cpu")) == va.VARLEN_SDPA
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(9, 16, (64,), generator=g).tolist()  # all in the 16-token bucket
    seqs = [torch.randint(3, 300, (n + 1,), generator=g).tolist() for n in lengths]
    packed = pack([s[:-1] for s in seqs], [s[1:] for s in seqs])
    counter = _CountSdpa(monkeypatch)
    logprobs, _ = packed_logprobs(model, packed, chunk_tokens=1024)
    logprobs.sum().backward()
    assert counter.calls == layers  # forward; backward reuses the saved attention, no per-sample calls
    # The same numbers as the padded batch (each row its own causal attention).
    width = max(lengths)
    inputs = torch.tensor([s[:-1] + [0] * (width - len(s) + 1) for s in seqs])
    targets = torch.tensor([s[1:] + [0] * (width - len(s) + 1) for s in seqs])
    with torch.no_grad():
        padded, _ = target_logprobs(model, inputs, targets)
    real = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    torch.testing.assert_close(packed.to_padded(logprobs.detach())[real], padded[real], atol=1e-5, rtol=1e-5)


def test_the_choice_is_logged_once_per_path_and_device(tiny_model_dir, caplog, monkeypatch):
    monkeypatch.setattr(va, "_logged", set())
    q, k, v = _qkv([4, 5, 6])
    bounds = pack([[1] * n for n in (4, 5, 6)], [[1] * n for n in (4, 5, 6)]).attention_bounds()
    with caplog.at_level("INFO", logger=va.__name__):
        for _ in range(3):
            va.varlen_sdpa(torch.nn.Module(), q, k, v, None, **bounds)
    lines = [r.getMessage() for r in caplog.records if "packed attention on" in r.getMessage()]
    assert lines == ["packed attention on cpu: bucketed_sdpa (docs/trainer.md, which path runs on which device)"]
