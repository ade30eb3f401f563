"""Per-token logprobs of packed sequences, with the vocabulary projection computed in chunks.

Two things make a real model's logprob forward affordable:

- **Packing.** A micro-batch's samples are concatenated into one row, each with its own position ids (0, 1, ...).
  transformers reads sequence boundaries from the position ids (`find_packed_sequence_indices`): with
  flash-attention it runs variable-length attention, with sdpa or eager a block-diagonal causal mask, so every
  token attends only to earlier tokens of its own sample and no compute is spent on padding anywhere else
  (embeddings, projections, MLPs, the vocabulary head). `PackedBatch.to_padded` turns the per-token results back into
  the `[B, T]` layout the losses take: that costs B x T floats, never B x T x V.
- **Chunked logprobs.** The output projection (lm_head) is replaced, for the length of one forward, by a head that
  projects `chunk_tokens` positions at a time, takes the float32 log-softmax, gathers the target's logprob (and the
  entropy, without gradient) and drops the logits. With gradient the chunk is checkpointed, so backward recomputes
  one chunk's logits at a time: the full `[tokens, V]` float32 tensor (about 5 GB per 8k tokens at a 152k
  vocabulary, and twice that with the log-softmax kept for backward) never exists. The head runs inside the
  model's own forward, so FSDP2 has the root's parameters (lm_head among them) unsharded and reduces their gradient
  as usual.

Models whose forward post-processes logits after lm_head (final logit soft-capping) are refused: the chunked head
would hand them logprobs where they expect logits.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fleetrl.trainer.kernels import Kernels, model_kernels

DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class PackedBatch:
    """Datums end to end in one row: inputs, targets and position ids `[1, N]` (N = the sum of the lengths)."""

    input_ids_1N: torch.Tensor  # long
    position_ids_1N: torch.Tensor  # long, restarting at 0 for every sample
    targets_N: torch.Tensor  # long
    lengths: list[int]  # tokens of each sample, in order

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1N.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids_1N.to(device), self.position_ids_1N.to(device), self.targets_N.to(device), self.lengths
        )

    def attention_bounds(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """The samples' bounds as transformers' flash-attention kwargs (`cu_seq_lens_q/k` int32, `max_length_q/k`),
        computed once per forward: variable-length attention then needs no look at the position ids in each layer
        (a device sync per layer on CUDA). The bounds stay on the host (what `varlen_sdpa` reads without a device
        sync) unless `device` is given (flash-attention 2 reads them there)."""
        cu = torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int32)
        if device is not None:
            cu = cu.to(device)
        longest = max(self.lengths)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def to_padded(self, values_N: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Per-token values `[N]` as right-padded rows `[B, width]` (zeros after each sample's end), keeping the
        autograd graph. `width` defaults to the longest sample."""
        width = max(self.lengths) if width is None else width
        if width < max(self.lengths):
            raise ValueError(f"to_padded: width {width} is shorter than the longest sample ({max(self.lengths)})")
        # One gather (a pad per sample before): each row's positions in `values_N`, padding reading an appended 0;
        # built from host figures, so nothing reads the device.
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        steps = torch.arange(width, dtype=torch.long).unsqueeze(0)
        index_BW = torch.where(steps < lengths.unsqueeze(1), starts.unsqueeze(1) + steps, values_N.shape[0])
        padded = torch.cat([values_N, values_N.new_zeros(1)])
        return padded.index_select(0, index_BW.flatten().to(values_N.device)).view(len(self.lengths), width)


def pack(inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> PackedBatch:
    """Pack per-sample input and target token lists (equal lengths, each at least 1) into one row."""
    if not inputs:
        raise ValueError("pack: no samples")
    lengths = [len(x) for x in inputs]
    for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
        if not x or len(x) != len(y):
            raise ValueError(f"pack: sample {i} has {len(x)} inputs and {len(y)} targets (need equal, >= 1)")
    flat_in = torch.tensor([t for x in inputs for t in x], dtype=torch.long)
    flat_tg = torch.tensor([t for y in targets for t in y], dtype=torch.long)
    lengths_t, total = torch.tensor(lengths, dtype=torch.long), sum(lengths)
    starts = torch.repeat_interleave(torch.cumsum(lengths_t, 0) - lengths_t, lengths_t, output_size=total)
    positions = torch.arange(total, dtype=torch.long) - starts  # 0, 1, ... within each sample (no scalar read)
    return PackedBatch(flat_in.unsqueeze(0), positions.unsqueeze(0), flat_tg, lengths)


def _chunk_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden_NH, weight_VH, bias_V).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse_N = torch.logsumexp(logits, dim=-1)
    logprobs_N = logits.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1) - lse_N
    if not with_entropy:
        return logprobs_N, logprobs_N.new_zeros(())
    with torch.no_grad():
        # H = lse - sum(p * logits): one pass, no [N, V] log-softmax kept.
        probs = torch.softmax(logits.detach(), dim=-1)
        entropy_N = lse_N.detach() - (probs * logits.detach()).sum(-1)
    return logprobs_N, entropy_N


class _Head:
    """What the swapped-in lm_head computes: logprobs of `targets` (and entropy) chunk by chunk, or through the
    model's fused linear-logprob kernel (fleetrl.trainer.kernels) when one is swapped in for this device."""

    def __init__(
        self,
        linear: torch.nn.Module,
        targets_N: torch.Tensor,
        temperature: float,
        chunk: int,
        entropy: bool,
        kernels: Kernels | None = None,
        positions_N: torch.Tensor | None = None,
    ) -> None:
        self.linear = linear
        self.targets_N = targets_N
        self.positions_N = positions_N  # only these positions' logprobs (and entropy) are computed; others are 0
        self.temperature = temperature
        self.chunk = chunk
        self.entropy = entropy
        self.kernels = kernels
        self.entropy_N: torch.Tensor | None = None

    def _fused(
        self, hidden_NH: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets_N: torch.Tensor
    ) -> torch.Tensor:
        """Target logprobs through the kernel ((h / T) W^T + b / T is the tempered logits); the entropy, a metric
        without gradient, chunk by chunk in plain torch."""
        assert self.kernels is not None
        t = self.temperature
        scaled = hidden_NH if t == 1.0 else hidden_NH / t
        scaled_bias = bias if bias is None or t == 1.0 else bias / t
        logprobs_N = self.kernels.linear_logprobs(scaled, weight, scaled_bias, targets_N)
        if self.entropy:
            with torch.no_grad():
                parts = [
                    _chunk_logprobs(
                        hidden_NH[s : s + self.chunk], weight, bias, targets_N[s : s + self.chunk], t, True
                    )[1]
                    for s in range(0, hidden_NH.shape[0], self.chunk)
                ]
            self.entropy_N = torch.cat(parts)
        return logprobs_N

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden_NH = hidden.reshape(-1, hidden.shape[-1])
        if hidden_NH.shape[0] != self.targets_N.shape[0]:
            raise ValueError(f"chunked head: {hidden_NH.shape[0]} positions for {self.targets_N.shape[0]} targets")
        if self.positions_N is None:
            return self._logprobs(hidden_NH, self.targets_N).view(hidden.shape[:-1])
        # Only the positions a loss reads (the trainable ones) go through the vocabulary projection: the prompt's
        # logits are never needed, and the head is the one part of the forward that can skip them. The others
        # are 0 (no gradient), which every loss masks out (fleetrl.losses.policy cleans masked positions).
        positions = self.positions_N
        picked = self._logprobs(hidden_NH.index_select(0, positions), self.targets_N.index_select(0, positions))
        full = picked.new_zeros(hidden_NH.shape[0]).index_copy(0, positions, picked)
        if self.entropy_N is not None:
            self.entropy_N = self.entropy_N.new_zeros(hidden_NH.shape[0]).index_copy(0, positions, self.entropy_N)
        return full.view(hidden.shape[:-1])

    def _logprobs(self, hidden_NH: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """Target logprobs `[N]` of `hidden_NH` (and `entropy_N`, when asked)."""
        weight, bias = self.linear.weight, getattr(self.linear, "bias", None)
        if self.kernels is not None and self.kernels.device_type in (None, hidden_NH.device.type):
            return self._fused(hidden_NH, weight, bias, targets_N)
        grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or weight.requires_grad)
        # A row of one chunk keeps its logits for backward instead of recomputing them: the head's backward runs
        # first, while every layer's activations are still alive, so the peak is the same either way, and the
        # recomputation cost ~5 % of a CPU step of the main job (bench/trainer_packing.py paths).
        recompute = grad and hidden_NH.shape[0] > self.chunk
        out, ent = [], []
        for start in range(0, hidden_NH.shape[0], self.chunk):
            part = slice(start, start + self.chunk)
            args = (hidden_NH[part], weight, bias, targets_N[part], self.temperature, self.entropy)
            if recompute:  # several chunks: each one's logits are recomputed in backward, never all alive at once
                lp, h = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                lp, h = _chunk_logprobs(*args)
            out.append(lp)
            ent.append(h)
        if self.entropy:
            self.entropy_N = torch.cat(ent) if ent else hidden_NH.new_zeros(0, dtype=torch.float32)
        return torch.cat(out) if out else hidden_NH.new_zeros(0, dtype=torch.float32)


@contextlib.contextmanager
def _chunked_head(model: torch.nn.Module, head: _Head) -> Iterator[None]:
    """lm_head computes `head` instead of logits for the length of the block (the module and its parameters stay
    where they are: only its forward is replaced, on this instance)."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError(
            "chunked logprobs: this model soft-caps its logits after lm_head (final_logit_softcapping); "
            "set logprob_chunk_tokens = 0 to compute full logits"
        )
    linear = model.get_output_embeddings()
    if linear is None or not hasattr(linear, "weight"):
        raise ValueError("chunked logprobs: the model has no linear output embedding (lm_head)")
    head.linear = linear
    linear.forward = head  # type: ignore[method-assign]
    try:
        yield
    finally:
        del linear.forward


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target logprobs `[N]` (float32) of a packed batch, and the entropy `[N]` (no gradient) when asked.

    `chunk_tokens` positions go through the vocabulary projection at a time (0: the whole row at once, through the
    model's own lm_head: full logits, for models the chunked head refuses). `positions` (long, on the batch's
    device): only these positions go through the chunked head, the others' logprobs and entropy are 0 (a loss
    reads only its trainable positions; ignored with full logits)."""
    kwargs: dict[str, Any] = {"input_ids": batch.input_ids_1N, "position_ids": batch.position_ids_1N}
    flash2 = getattr(getattr(model, "config", None), "_attn_implementation", None) == "flash_attention_2"
    kwargs.update(batch.attention_bounds(batch.input_ids_1N.device if flash2 else None))
    if chunk_tokens <= 0:
        logits = model(**kwargs, use_cache=False).logits[0].float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        logprobs = logp.gather(-1, batch.targets_N.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.detach().exp() * logp.detach()).sum(-1) if entropy else None
        return logprobs, ent
    head = _Head(
        torch.nn.Identity(), batch.targets_N, temperature, chunk_tokens, entropy, model_kernels(model), positions
    )
    with _chunked_head(model, head):
        logprobs = model(**kwargs, use_cache=False).logits
    return logprobs.reshape(-1), head.entropy_N


def padded_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target logprobs `[B, T]` (float32) of right-padded rows through the same chunked head as `packed_logprobs`
    (so the two layouts differ only in their rows), and the entropy `[B, T]` (no gradient) when asked. Padding
    positions get values too; the losses mask them. No attention mask, as `fleetrl.trainer.model.forward_logits`.
    `positions`: flat indices into `[B * T]`, as in `packed_logprobs`."""
    if chunk_tokens <= 0:
        raise ValueError(
            "padded_logprobs: chunk_tokens must be > 0 (full logits: fleetrl.trainer.model.target_logprobs)"
        )
    head = _Head(
        torch.nn.Identity(),
        targets_BT.reshape(-1),
        temperature,
        chunk_tokens,
        entropy,
        model_kernels(model),
        positions,
    )
    with _chunked_head(model, head):
        logprobs_BT = model(input_ids=input_ids_BT, use_cache=False).logits
    entropy_BT = head.entropy_N.view(targets_BT.shape) if head.entropy_N is not None else None
    return logprobs_BT.view(targets_BT.shape), entropy_BT


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> int:
    """Turn activation checkpointing of the decoder layers on or off for the next forwards, as installed
    (fleetrl.trainer.layers: whole layers, every k-th, attention or MLP only; or HF's `gradient_checkpointing_enable`,
    every whole layer); returns how many layers (or sublayers) are now checkpointed."""
    from fleetrl.trainer.layers import set_checkpointing

    return set_checkpointing(model, on)
