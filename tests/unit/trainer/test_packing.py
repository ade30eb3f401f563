"""Packed micro-batches and chunked logprobs compute what the padded, full-logits path computes.

Tolerances: logprobs and entropy agree to 1e-5 absolute (float32; the packed row runs attention under a
block-diagonal mask instead of the plain causal kernel, and the chunked head sums its log-softmax per chunk), losses
to 1e-5 relative and gradients to 1e-4 relative to the largest gradient entry; a whole step's weights to 1% of the
update (relative L2 norm 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fleetrl.losses import LOSS_NAMES
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.datum import Datum, collate
from fleetrl.trainer.logprobs import pack, packed_logprobs
from fleetrl.trainer.model import load_causal_lm, target_logprobs
from tests.unit.trainer.helpers import make_cfg, tiny_groups

LENGTHS = [5, 17, 3, 30, 9]


def _datums(seed: int = 0) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        seq = torch.randint(3, 300, (n + 1,), generator=g).tolist()
        weights = [0] * (n // 3) + [1] * (n - n // 3)  # a prompt part, then the completion
        rollout = (-torch.rand(n, generator=g)).tolist()
        out.append(Datum(seq[:-1], seq[1:], weights, rollout))
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir)


@pytest.mark.parametrize("chunk", [0, 7, 1024])
def test_packed_chunked_logprobs_and_entropy_equal_the_padded_full_logits(model, chunk):
    datums = _datums()
    batch = collate(datums)
    with torch.no_grad():
        padded_lp, padded_ent = target_logprobs(
            model, batch.input_tokens_BT, batch.target_tokens_BT, temperature=0.7, entropy_mask_BT=batch.mask_BT
        )
        packed = pack([d.input_tokens for d in datums], [d.target_tokens for d in datums])
        lp_N, ent_N = packed_logprobs(model, packed, temperature=0.7, chunk_tokens=chunk, entropy=True)
    assert lp_N.shape == (sum(LENGTHS),)
    real = batch.attention_mask_BT.bool()
    assert torch.allclose(packed.to_padded(lp_N)[real], padded_lp[real], atol=1e-5)
    keep = batch.mask_BT.bool()
    assert torch.allclose(packed.to_padded(ent_N)[keep], padded_ent[keep], atol=1e-5)


def _loss_and_grads(trainer: PolicyTrainer, datums, advantages, *, packing: bool, budget: int | None):
    loop = trainer.loop
    loop.packing, loop.micro_batch_tokens = packing, budget
    trainer.model.zero_grad(set_to_none=True)
    out = loop.accumulate_gradients(datums, advantages, list(range(len(datums))))
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize(
    ("loss", "agg"),
    [
        ("grpo", "token-mean"),
        ("grpo", "seq-mean-token-mean"),
        ("grpo", "seq-mean-token-sum-norm"),
        ("grpo", "sum"),
        ("gspo", "token-mean"),
        ("cispo", "token-mean"),
    ],
)
def test_packed_micro_batches_give_the_padded_loss_and_gradients(tiny_model_dir, tmp_path, loss, agg):
    assert loss in LOSS_NAMES
    cfg = make_cfg(tiny_model_dir, tmp_path, policy_loss=loss, loss_agg_mode=agg, logprob_chunk_tokens=8)
    trainer = PolicyTrainer(cfg)
    datums = _datums(1)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])
    padded, padded_grads = _loss_and_grads(trainer, datums, advantages, packing=False, budget=None)
    for budget in (None, 20, 1):  # one micro-batch; a few; one sample each (a row longer than the budget goes alone)
        packed, packed_grads = _loss_and_grads(trainer, datums, advantages, packing=True, budget=budget)
        assert packed["_loss"] == pytest.approx(padded["_loss"], rel=1e-5, abs=1e-7), budget
        assert packed["_tokens"] == padded["_tokens"]
        scale = max(g.abs().max().item() for g in padded_grads.values())
        for name, grad in padded_grads.items():
            assert (packed_grads[name] - grad).abs().max().item() <= 1e-4 * scale, (budget, name)
    trainer.close()


def test_a_packed_step_trains_the_weights_the_padded_step_trains(tiny_model_dir, tmp_path):
    """The whole step (the old-logprob pass of num_minibatches = 2 included) over the same groups."""
    groups = tiny_groups(tiny_model_dir, num_groups=2, group_size=4)
    results = {}
    for packing in (False, True):
        cfg = make_cfg(
            tiny_model_dir, tmp_path / str(packing), packing=packing, num_minibatches=2, micro_batch_tokens=40
        )
        trainer = PolicyTrainer(cfg)
        metrics = trainer.train_step(groups).metrics
        results[packing] = (metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        trainer.close()
    (m_pad, w_pad), (m_pack, w_pack) = results[False], results[True]
    for key in ("train/loss", "optim/grad_norm", "optim/entropy"):
        assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-4, abs=1e-5), key
    # AdamW's first steps move every weight by about lr whatever its gradient's size, so where a gradient is ~0 a
    # float32 rounding difference can flip a weight's step: compare the updates as a whole (relative L2 norm).
    base = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path / "base"))
    start = {n: p.detach() for n, p in base.model.named_parameters()}
    pad_update = torch.cat([(w - start[n]).flatten() for n, w in w_pad.items()])
    pack_update = torch.cat([(w_pack[n] - start[n]).flatten() for n in w_pad])
    assert pad_update.norm() > 0
    assert ((pack_update - pad_update).norm() / pad_update.norm()).item() < 1e-2
    base.close()


class _LargestLogits(TorchDispatchMode):
    """The most rows of any vocabulary-wide tensor (last dimension = the vocabulary: logits, log-softmax, their
    gradients) an op produced, forward and backward."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_chunked_logprobs_never_build_the_tokens_by_vocab_tensor(model):
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (120, 200, 80)]
    packed = pack([s[:-1] for s in seqs], [s[1:] for s in seqs])
    # A chunk wider than the hidden size, so the lm_head weight's transpose ([H, V], a view) counts less.
    vocab, tokens, chunk = model.config.vocab_size, packed.num_tokens, 100
    assert model.config.hidden_size < chunk < tokens
    rows = {}
    for name, chunk_tokens in (("full", 0), ("chunked", chunk)):
        model.zero_grad(set_to_none=True)
        with _LargestLogits(vocab) as probe:
            lp, ent = packed_logprobs(model, packed, chunk_tokens=chunk_tokens, entropy=True)
            (lp.sum() + 0 * ent.sum()).backward()
        rows[name] = probe.rows
    model.zero_grad(set_to_none=True)
    assert rows["full"] == tokens  # the full path builds [tokens, V]: the probe sees it
    assert rows["chunked"] == chunk  # forward and backward: one chunk's logits at a time


class _SquareTensors(TorchDispatchMode):
    """Whether an op produced a tensor with two trailing dimensions of `n` (an [n, n] attention mask or scores)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.n, self.n):
                self.seen = True
        return out


def test_variable_length_attention_matches_and_never_builds_a_row_by_row_tensor(tiny_model_dir, tmp_path):
    from fleetrl.trainer.varlen_attention import VARLEN_SDPA, use_packed_attention

    model = load_causal_lm(tiny_model_dir)
    datums = _datums()[:4]
    packed = pack([d.input_tokens for d in datums], [d.target_tokens for d in datums])
    n = packed.num_tokens
    assert n not in (model.config.hidden_size, model.config.intermediate_size, model.config.vocab_size)
    with torch.no_grad(), _SquareTensors(n) as masked_probe:
        masked, _ = packed_logprobs(model, packed, chunk_tokens=16)
    assert masked_probe.seen  # sdpa over a packed row: an [N, N] block-diagonal mask
    assert use_packed_attention(model, torch.device("cpu")) == VARLEN_SDPA
    with _SquareTensors(n) as varlen_probe:
        varlen, _ = packed_logprobs(model, packed, chunk_tokens=16)
        varlen.sum().backward()
    assert not varlen_probe.seen
    assert torch.allclose(varlen, masked, atol=1e-5)
    # The padded path (several rows, no position ids) still works under the new implementation.
    batch = collate(datums)
    with torch.no_grad():
        padded, _ = target_logprobs(model, batch.input_tokens_BT, batch.target_tokens_BT)
    real = batch.attention_mask_BT.bool()
    assert torch.allclose(packed.to_padded(varlen.detach())[real], padded[real], atol=1e-5)
    # The export names no fleetrl-only attention: replicas and users load it with their own.
    model.save_pretrained(tmp_path / "export")
    assert VARLEN_SDPA not in (tmp_path / "export" / "config.json").read_text()


def test_sequence_logprobs_run_one_packed_row_with_the_padded_numbers(model):
    """The reference service's forward (and synthetic rollouts'): one row of the sequences end to end."""
    from fleetrl.trainer.model import sequence_logprobs

    sequences = [[5, 9, 200, 31, 7], [1, 2], [300, 301, 302, 303, 304, 305, 306, 307, 308]]
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda _m, args, _o: shapes.append(tuple(args[0].shape)))
    got = sequence_logprobs(model, sequences, temperature=0.8, chunk_tokens=4)
    hook.remove()
    assert shapes == [(1, sum(len(s) - 1 for s in sequences))]
    for seq, row in zip(sequences, got, strict=True):
        ids = torch.tensor([seq])
        with torch.no_grad():
            alone, _ = target_logprobs(model, ids[:, :-1], ids[:, 1:], temperature=0.8)
        assert torch.allclose(torch.tensor(row), alone[0], atol=1e-5)


def _qkv(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(1, heads, n, dim, generator=g)
    k = torch.randn(1, kv_heads, n, dim, generator=g)
    v = torch.randn(1, kv_heads, n, dim, generator=g)
    return q, k, v


def _per_sample(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, enable_gqa=True
            )
        )
        start += n
    return torch.cat(out, dim=2).transpose(1, 2)


def test_variable_length_attention_takes_the_bounds_the_trainer_passes_not_the_position_ids():
    """packed_logprobs passes the samples' bounds (cu_seq_lens) once per forward; each layer's attention uses them
    and needs no position ids (on CUDA, reading position ids cost a device sync in every layer)."""
    from fleetrl.trainer.logprobs import pack
    from fleetrl.trainer.varlen_attention import varlen_sdpa

    lengths = [5, 3, 7]
    q, k, v = _qkv(lengths)
    batch = pack([[1] * n for n in lengths], [[1] * n for n in lengths])
    bounds = batch.attention_bounds()
    assert bounds["cu_seq_lens_q"].tolist() == [0, 5, 8, 15] and bounds["max_length_q"] == 7
    out, _ = varlen_sdpa(torch.nn.Module(), q, k, v, None, **bounds)  # no position ids at all
    torch.testing.assert_close(out, _per_sample(q, k, v, lengths))


def test_the_cuda_kernel_path_gets_the_row_as_tokens_by_heads_and_causal_bounds(monkeypatch):
    """The layout handed to torch's varlen_attn (a CUDA-only kernel, stood in for here by per-sample sdpa over the
    same arguments): [N, heads, D] tensors, int32 cumulative bounds, causal, grouped kv heads expanded."""
    from fleetrl.trainer import varlen_attention

    calls = []

    def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None):
        calls.append((query.shape, key.shape, cu_seq_q.dtype, max_q, window_size))
        assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k)
        out = []
        for s, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (query, key, value))
            out.append(
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(
                    0, 1
                )
            )
        return torch.cat(out)

    monkeypatch.setattr(varlen_attention, "_torch_varlen", lambda: fake_varlen_attn)
    monkeypatch.setattr(varlen_attention, "use_varlen_kernel", lambda query, dropout=0.0, samples=None: True)
    lengths = [4, 9, 2]
    q, k, v = _qkv(lengths, seed=1)
    from fleetrl.trainer.logprobs import pack

    bounds = pack([[1] * n for n in lengths], [[1] * n for n in lengths]).attention_bounds()
    out, _ = varlen_attention.varlen_sdpa(torch.nn.Module(), q, k, v, None, scaling=0.5, **bounds)
    assert calls == [((15, 4, 8), (15, 4, 8), torch.int32, 9, (-1, 0))]
    expected = _per_sample(q * (0.5 * 8**0.5), k, v, lengths)  # scale 0.5 instead of 1/sqrt(8)
    torch.testing.assert_close(out, expected)


def test_padded_rows_take_the_packed_rows_chunked_head_with_the_full_logits_numbers(tiny_model_dir, tmp_path):
    """packing = false runs the same chunked head as packed rows (the two layouts then differ only in their rows),
    and computes what full logits compute."""
    chunk = 100  # wider than the hidden size (the lm_head weight's [H, V] transpose counts less), under B x T
    cfg = make_cfg(tiny_model_dir, tmp_path, logprob_chunk_tokens=chunk, packing=False)
    trainer = PolicyTrainer(cfg)
    datums = _datums(2)
    assert trainer.model.config.hidden_size < chunk < len(datums) * max(LENGTHS)
    advantages = torch.tensor([0.5, -1.0, 1.0, -0.25, 0.75])
    vocab = trainer.model.config.vocab_size
    with _LargestLogits(vocab) as probe:
        chunked, chunked_grads = _loss_and_grads(trainer, datums, advantages, packing=False, budget=None)
    trained = sum(sum(1 for w in d.weights if w) for d in datums)  # only these positions reach the head
    hidden = trainer.model.config.hidden_size  # the lm_head weight's [H, V] transpose counts too
    assert probe.rows == max(min(chunk, trained), hidden)  # one chunk's logits at a time, never [B, T, V]
    trainer.loop.chunk_tokens = 0
    full, full_grads = _loss_and_grads(trainer, datums, advantages, packing=False, budget=None)
    assert chunked["_loss"] == pytest.approx(full["_loss"], rel=1e-5, abs=1e-7)
    assert chunked["_tok/entropy"] == pytest.approx(full["_tok/entropy"], rel=1e-5)
    scale = max(g.abs().max().item() for g in full_grads.values())
    for name, grad in full_grads.items():
        assert (chunked_grads[name] - grad).abs().max().item() <= 1e-4 * scale, name
    trainer.close()


@pytest.mark.parametrize("packing", [True, False])
def test_the_head_projects_only_the_trained_positions_with_the_same_loss_and_gradients(
    tiny_model_dir, tmp_path, packing
):
    """The prompt's logits are never read by a loss: the chunked head projects only the positions with a weight
    (here 2/3 of the tokens), and the loss, the entropy metric and every gradient equal those of full logits."""
    cfg = make_cfg(tiny_model_dir, tmp_path, packing=packing)
    trainer = PolicyTrainer(cfg)
    g = torch.Generator().manual_seed(3)
    datums = []
    for n in (40, 61, 30, 52, 45):
        seq = torch.randint(3, 300, (n + 1,), generator=g).tolist()
        weights = [0] * (n // 3) + [1] * (n - n // 3)  # a prompt part, then the completion
        datums.append(Datum(seq[:-1], seq[1:], weights, (-torch.rand(n, generator=g)).tolist()))
    advantages = torch.tensor([0.5, -1.0, 1.0, -0.25, 0.75])
    trained = sum(sum(1 for w in d.weights if w) for d in datums)
    # More trained positions than the hidden size (the lm_head weight's [H, V] transpose counts too), fewer than
    # all positions, all within one chunk.
    assert trainer.model.config.hidden_size < trained < sum(len(d) for d in datums) < trainer.loop.chunk_tokens
    with _LargestLogits(trainer.model.config.vocab_size) as probe:
        picked, picked_grads = _loss_and_grads(trainer, datums, advantages, packing=packing, budget=None)
    assert probe.rows == trained
    trainer.loop.chunk_tokens = 0  # full logits at every position (the model's own lm_head)
    full, full_grads = _loss_and_grads(trainer, datums, advantages, packing=packing, budget=None)
    assert picked["_loss"] == pytest.approx(full["_loss"], rel=1e-5, abs=1e-7)
    assert picked["_tok/entropy"] == pytest.approx(full["_tok/entropy"], rel=1e-5)
    scale = max(g.abs().max().item() for g in full_grads.values())
    for name, grad in full_grads.items():
        assert (picked_grads[name] - grad).abs().max().item() <= 1e-4 * scale, name
    trainer.close()
