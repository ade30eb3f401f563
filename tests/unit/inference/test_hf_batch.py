"""services/inference/hf_batch.py: a left-padded shared KV cache gives each row the logits it would get
alone, through joins of rows of different lengths and removals."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from fleetrl.services.inference.hf_batch import KVBatch


def _alone(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_batched_decode_matches_each_sequence_alone(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = KVBatch(model)
    seqs = {"a": [5, 6, 7], "b": [9], "c": [20, 21, 22, 23, 24, 25, 26]}
    logits = batch.prefill([seqs["a"], seqs["b"]], [["a"], ["b", "b2"]])
    seqs["b2"] = list(seqs["b"])
    assert batch.rows == ["a", "b", "b2"]
    gen = torch.Generator().manual_seed(0)

    def step(logits_BV: torch.Tensor, first: int) -> None:
        for i, name in enumerate(batch.rows[first:]):
            torch.testing.assert_close(logits_BV[i], _alone(model, seqs[name]), atol=1e-4, rtol=0)
            token = int(torch.randint(0, logits_BV.shape[-1], (1,), generator=gen))
            seqs[name].append(token)
            batch.next_B[first + i] = token

    step(logits, 0)
    step(batch.decode(), 0)
    step(batch.prefill([seqs["c"]], [["c"]]), 3)  # a longer prompt joins mid-flight
    for _ in range(3):
        step(batch.decode(), 0)
    batch.keep([1, 3])  # "b" and "c" stay
    assert batch.rows == ["b", "c"]
    for _ in range(3):
        step(batch.decode(), 0)
    assert batch.cache_len == len(seqs["c"]) - 1  # padding columns nobody uses were trimmed
    batch.keep([])
    assert len(batch) == 0


def test_rebuild_recomputes_the_cache_with_new_weights(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = KVBatch(model)
    seqs = {"a": [5, 6, 7, 8], "b": [9, 10]}
    batch.prefill([seqs["a"], seqs["b"]], [["a"], ["b"]])
    batch.next_B[:] = torch.tensor([30, 31])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    batch.rebuild([seqs["a"], seqs["b"]])
    assert batch.rows == ["a", "b"] and batch.next_B.tolist() == [30, 31]
    logits = batch.decode()
    for i, name in enumerate(("a", "b")):
        want = _alone(model, [*seqs[name], 30 + i])
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=0)
