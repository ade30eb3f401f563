"""Token sampling for the hf engine: temperature, top-k, top-p, and the logprobs of what was sampled.

Pure torch, no I/O. `processed_logprobs` returns log-probabilities of the distribution actually sampled from:
logits / temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019) truncation, renormalised by the final
log_softmax. The truncation order and tie rules follow vLLM's `apply_top_k_top_p` so that both engines sample
from the same distribution:
- top-k keeps every token whose scaled logit is >= the k-th largest (ties at the threshold are kept);
- top-p sorts ascending and drops the tokens whose cumulative probability (from the least likely up) is
  <= 1 - p, always keeping the most likely token.
Rows with temperature 0 are greedy: the argmax, reported with the untempered log_softmax (as vLLM does).
"""

from __future__ import annotations

import torch


def processed_logprobs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
) -> torch.Tensor:
    """Log-probabilities [B, V] (float32, -inf outside the kept set) of the distribution sampled from.

    temperature_B: float, 0 = greedy; top_k_B: int64, 0 = off; top_p_B: float, 1.0 = off.
    """
    logits_BV = logits_BV.float()
    vocab = logits_BV.shape[-1]
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    scaled_BV = logits_BV / temp_B[:, None]
    top_k_B = torch.where(greedy_B | (top_k_B <= 0), torch.full_like(top_k_B, vocab), top_k_B)
    top_k_B = top_k_B.clamp(max=vocab)
    top_p_B = torch.where(greedy_B, torch.ones_like(top_p_B), top_p_B).float()
    use_k = bool((top_k_B < vocab).any())
    use_p = bool((top_p_B < 1.0).any())
    if use_k or use_p:
        sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=False)
        if use_k:
            threshold_B1 = sorted_BV.gather(1, (vocab - top_k_B).long()[:, None])
            sorted_BV = sorted_BV.masked_fill(sorted_BV < threshold_B1, float("-inf"))
        if use_p:
            cum_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
            drop_BV = cum_BV <= (1.0 - top_p_B)[:, None]
            drop_BV[:, -1] = False  # the most likely token always survives
            sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        scaled_BV = torch.empty_like(scaled_BV).scatter_(1, order_BV, sorted_BV)
    return scaled_BV.log_softmax(dim=-1)


def sample_tokens(
    logprobs_BV: torch.Tensor,
    greedy_B: torch.Tensor,
    generators: list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row with that row's own generator (so a seeded sequence does not depend on what
    else is in the batch). Returns (token_ids [B] int64, their logprobs [B] float32), on `logprobs_BV`'s device.

    Inverse-CDF sampling: each row's generator (a CPU generator) draws one uniform number, and the whole batch is
    searched in its cumulative distribution at once, on the logprobs' device. A per-row `torch.multinomial` over
    a 152k vocabulary cost about 5 ms a row on the CPU (0.13-0.17 s a step for 32 rows), which made an H100 generate
    123 tokens/s (bench/gpu_check.py, check 5). The cumulative sum accumulates in float64, so the last tokens of a long
    vocabulary keep their share; a token of probability 0 (outside top-k / top-p) is never drawn."""
    device = logprobs_BV.device
    u_B = torch.cat([torch.rand(1, generator=gen, dtype=torch.float64) for gen in generators]).to(device)
    cdf_BV = logprobs_BV.exp().cumsum(dim=-1, dtype=torch.float64)
    total_B1 = cdf_BV[:, -1:].contiguous()
    drawn_B1 = torch.searchsorted(cdf_BV, u_B[:, None] * total_B1, right=True)
    # Rounding can put the target at the total itself: take the last token with a share (the first index where
    # the sum reaches the total), never one without.
    last_B1 = torch.searchsorted(cdf_BV, total_B1, right=False)
    # Clamped into the vocabulary: non-finite logits (a broken model) must not index past it (on CUDA, a device-side
    # assert that poisons the whole context); what they draw is meaningless either way.
    drawn_B = torch.minimum(drawn_B1, last_B1).squeeze(1).clamp_(max=logprobs_BV.shape[-1] - 1)
    token_B = torch.where(greedy_B.to(device), logprobs_BV.argmax(dim=-1), drawn_B)
    return token_B, logprobs_BV.gather(1, token_B[:, None]).squeeze(1)
