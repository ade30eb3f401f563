"""The PPO inner loop: forward/backward over micro-batches and ranks, and the optimizer step.

`InnerLoop.train_batch(datums, advantages, ...)` runs `num_minibatches` optimizer steps over one batch (the
PPO inner loop of Schulman et al. 2017: `old_logprobs` fixed at the start of the batch by a no-grad forward
when there is more than one minibatch, else old = current, detached). Each minibatch is split across
data-parallel ranks and each rank's share into micro-batches; every part's loss is scaled by its share of
the minibatch (fleetrl.trainer.minibatches.part_loss_scale) so the gradient is that of the whole minibatch.
`PolicyTrainer` owns one; tests call `accumulate_gradients` and `compute_logprobs` directly.

With a `reference_context` (LoRA: the PEFT model's `disable_adapter`), the reference logprobs of kl_beta > 0 are
a no-grad forward of this same model inside that context, on every rank and in the same micro-batches as the
training forward (FSDP's collectives need every rank in step): the base model without a second copy.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch

from fleetrl import metric_names as mn
from fleetrl.config import wants_reference_logprobs
from fleetrl.losses import resolve_loss_settings
from fleetrl.losses.policy import policy_loss_on_device
from fleetrl.trainer import distributed as fdist
from fleetrl.trainer.datum import Datum, collate
from fleetrl.trainer.logprobs import pack, packed_logprobs, padded_logprobs, set_activation_checkpointing
from fleetrl.trainer.minibatches import (
    SampleFigures,
    balance_by_tokens,
    part_loss_scale_of_counts,
    split_even,
    token_micro_batches,
)
from fleetrl.trainer.model import target_logprobs
from fleetrl.trainer.varlen_attention import VARLEN_SDPA, describe_choice, use_packed_attention

logger = logging.getLogger(__name__)

REF_WAIT_TIMEOUT_S = 1800.0  # the reference client has its own deadline; this bounds the wait whatever it does
AUTO_CHECKPOINT_TOKENS = 4096
"""gradient_checkpointing = "auto" recomputes activations in micro-batches of at least this many tokens."""


def resolve_compute_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The dtype forward and backward run in: `compute_dtype`, where "auto" is bfloat16 on CUDA (mixed precision
    over float32 weights) and the weights' own dtype elsewhere."""
    from fleetrl.trainer.model import torch_dtype

    name = getattr(cfg, "compute_dtype", "auto")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch_dtype(cfg.dtype)
    return torch_dtype(name)


def _trained_positions(weights: Sequence[float], device: torch.device) -> torch.Tensor | None:
    """The flat positions whose logprobs a loss reads (weight != 0), for the chunked head to project only those
    (the prompt's logits are never read). None (every position) when that is all or none of them."""
    picked = [i for i, w in enumerate(weights) if w]
    if not picked or len(picked) == len(weights):
        return None
    return torch.tensor(picked, dtype=torch.long).to(device)


def _pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


RefRows = Sequence[torch.Tensor] | Mapping[int, torch.Tensor]


class PendingRef:
    """Reference logprobs still on their way (the reference service computes them while this step runs): the first
    `get()` waits for them, once, and adds the wait to `timers["ref_wait"]`. The inner loop calls it right after the
    first micro-batch's forward, so the reference's forward overlaps the old-logprob pass and that forward; under
    several ranks every rank calls it at that same point (the loader may be a collective: rank 0 scatters each
    rank's samples)."""

    def __init__(self, load: Callable[[], RefRows], timers: dict[str, float]) -> None:
        self._load = load
        self._timers = timers
        self._rows: RefRows | None = None

    def get(self) -> RefRows:
        if self._rows is None:
            started = time.perf_counter()
            self._rows = self._load()
            self._timers["ref_wait"] = self._timers.get("ref_wait", 0.0) + time.perf_counter() - started
        return self._rows


def _mask_is_binary(micro: Sequence[Datum]) -> bool:
    """Whether every weight of `micro` is 0 or 1 (checked on the host; the loss then need not read the device).
    False lets the loss check, and refuse, the mask."""
    return all(w in (0, 1) for d in micro for w in d.weights)


def _figures_of(datums: Sequence[Datum] | Mapping[int, Datum], samples: Sequence[int]) -> SampleFigures:
    """The figures of `samples` (all present in `datums`), indexed by sample."""
    return SampleFigures({i: len(datums[i]) for i in samples}, {i: sum(datums[i].weights) for i in samples})  # type: ignore[arg-type]


class InnerLoop:
    """Gradient accumulation and optimizer steps for one model on this rank."""

    def __init__(
        self,
        cfg: Any,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        ctx: fdist.DistContext,
        device: torch.device,
        pad_id: int,
        micro_batch_size: int | None = None,
        reference_context: Callable[[], AbstractContextManager[Any]] | None = None,
        reference_model: torch.nn.Module | None = None,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 (or None), got {micro_batch_size}")
        self.cfg = cfg
        self.loss_name: str = cfg.policy_loss
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.ctx = ctx
        self.device = device
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.reference_context = reference_context
        self.reference_model = reference_model
        self.packing: bool = getattr(cfg, "packing", False)
        self.attention = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        self.micro_batch_tokens: int | None = getattr(cfg, "micro_batch_tokens", None)
        self.chunk_tokens: int = getattr(cfg, "logprob_chunk_tokens", 0)
        self.checkpointing: bool | str = getattr(cfg, "gradient_checkpointing", False)
        param_dtype = next(model.parameters()).dtype
        compute = resolve_compute_dtype(cfg, device)
        # Mixed precision on one process: autocast over the float32 weights (a sharded model gets FSDP2's
        # MixedPrecisionPolicy instead, fleetrl.trainer.distributed.shard_model).
        self.autocast_dtype: torch.dtype | None = (
            compute if compute != param_dtype and not ctx.enabled and param_dtype == torch.float32 else None
        )
        if self.packing:  # variable-length attention: each sample of a packed row at its own length squared
            for m in (model, reference_model):
                if m is not None:
                    self.attention = use_packed_attention(m, device)
        logger.info(
            "trainer rows on %s: %s",
            device.type,
            self.describe_rows(param_dtype if self.autocast_dtype is None else self.autocast_dtype),
        )
        self.optimizer_steps = 0
        self.timers: dict[str, float] = {}
        """Seconds spent per phase since the last reset (fwd_bwd, optim, old_logprobs, ref_wait)."""

    def describe_rows(self, dtype: torch.dtype) -> str:
        """The row layout and attention path this loop trains with, in words (logged once at start). Packed rows
        are never slower than padded ones once a packed row's attention is one call per length bucket on CPU
        (bench/trainer_packing.py paths; docs/trainer.md, which path runs on which device)."""
        if not self.packing:
            return "padded rows (packing = false): one causal sdpa call over [B, T] per layer"
        if self.attention != VARLEN_SDPA:
            return f"packed rows, attention {self.attention}"
        return f"packed rows, attention {describe_choice(dtype, self.device)}"

    def _loss_settings(self, width: int) -> Any:
        settings = resolve_loss_settings(self.loss_name, self.cfg)
        if settings.loss_agg_mode == "seq-mean-token-sum-norm" and settings.loss_agg_constant is None:
            # The constant must be the same in every micro-batch and on every rank: the padded
            # length of the whole minibatch, as if it ran in one piece.
            settings = replace(settings, loss_agg_constant=float(width))
        return settings

    def _my_micro_batches(self, samples: Sequence[int], figures: SampleFigures) -> list[list[int]]:
        """This rank's micro-batches of `samples` (its token-balanced share, cut by the token budget and
        micro_batch_size), padded with empty ones to the count of the busiest rank: FSDP's collectives run once
        per forward, so every rank must run as many."""
        lengths = figures.lengths
        shares = balance_by_tokens(samples, lengths, self.ctx.world_size)
        split = [token_micro_batches(s, lengths, self.micro_batch_tokens, self.micro_batch_size) for s in shares]
        count = max(1, *(len(parts) for parts in split))
        mine = split[self.ctx.rank]
        return mine + [[] for _ in range(count - len(mine))]

    def _compute(self) -> AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(
        self, batch: Any, micro: Sequence[Datum], *, entropy: bool, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target logprobs `[B, T]` (float32) of a micro-batch, and its entropy when asked: packed into one row
        (fleetrl.trainer.logprobs) or as the padded batch, under the compute dtype, with activation checkpointing
        as configured for its size."""
        model = self.model if model is None else model
        tokens = sum(len(d) for d in micro)
        if self.checkpointing == "auto" and model is self.model:
            set_activation_checkpointing(self.model, tokens >= AUTO_CHECKPOINT_TOKENS)
        with self._compute():
            if self.packing:
                packed = pack([d.input_tokens for d in micro], [d.target_tokens for d in micro]).to(self.device)
                logprobs_N, entropy_N = packed_logprobs(
                    model,
                    packed,
                    temperature=self.cfg.temperature,
                    chunk_tokens=self.chunk_tokens,
                    entropy=entropy,
                    positions=_trained_positions([w for d in micro for w in d.weights], self.device),
                )
                width = batch.input_tokens_BT.shape[1]
                return (
                    packed.to_padded(logprobs_N, width),
                    None if entropy_N is None else packed.to_padded(entropy_N, width),
                )
            if self.chunk_tokens > 0:  # the packed rows' chunked head, so that the two layouts compare
                return padded_logprobs(
                    model,
                    batch.input_tokens_BT.to(self.device),
                    batch.target_tokens_BT.to(self.device),
                    temperature=self.cfg.temperature,
                    chunk_tokens=self.chunk_tokens,
                    entropy=entropy,
                    positions=_trained_positions(batch.mask_BT.reshape(-1).tolist(), self.device),
                )
            mask = batch.mask_BT.to(self.device) if entropy else None
            logprobs, ent = target_logprobs(
                model,
                batch.input_tokens_BT.to(self.device),
                batch.target_tokens_BT.to(self.device),
                temperature=self.cfg.temperature,
                entropy_mask_BT=mask,
            )
            return logprobs.float(), ent

    def _collate(
        self, datums: Sequence[Datum] | Mapping[int, Datum], samples: Sequence[int]
    ) -> tuple[Any, int, list[Datum]]:
        if samples:
            micro = [datums[i] for i in samples]
            return collate(micro, pad_token_id=self.pad_id), len(samples), micro
        dummy = Datum([self.pad_id], [self.pad_id], [0], [0.0])
        return collate([dummy], pad_token_id=self.pad_id), 0, [dummy]

    @torch.no_grad()
    def compute_logprobs(
        self,
        datums: Sequence[Datum] | Mapping[int, Datum],
        minibatches: Sequence[Sequence[int]],
        timer: str = "old_logprobs",
        figures: SampleFigures | None = None,
        model: torch.nn.Module | None = None,
    ) -> dict[int, torch.Tensor]:
        """No-grad logprobs of the current policy for the samples this rank trains (sample -> [N-1] tensor):
        the `old_logprobs` of the PPO inner loop (or, in `reference_context`, the reference's). Same micro-batches
        as the training forward."""
        started = time.perf_counter()
        if figures is None:
            figures = _figures_of(datums, [s for samples in minibatches for s in samples])
        old: dict[int, torch.Tensor] = {}
        for samples in minibatches:
            for micro in self._my_micro_batches(samples, figures):
                batch, _, micro_datums = self._collate(datums, micro)
                logprobs, _ = self._forward(batch, micro_datums, entropy=False, model=model)
                for j, i in enumerate(micro):
                    old[i] = logprobs[j, : len(datums[i])].float().cpu()
        self.timers[timer] = self.timers.get(timer, 0.0) + time.perf_counter() - started
        return old

    def train_batch(
        self,
        datums: Sequence[Datum] | Mapping[int, Datum],
        advantages: torch.Tensor,
        ref_by_sample: RefRows | PendingRef | None,
        ref_future: Future[list[list[float]]] | None,
        figures: SampleFigures | None = None,
    ) -> dict[str, float]:
        """The PPO inner loop over one batch: old logprobs if needed, then one optimizer step per
        minibatch. Returns the batch's loss metrics (token-weighted over all ranks) under their per-step names
        (fleetrl.metric_names: `train/loss`, `optim/grad_norm`, `optim/entropy`, `train/clip_frac`, ...).
        With `figures` (every sample's length and trainable tokens), `datums` needs only this rank's samples (by
        index)."""
        figures = figures if figures is not None else SampleFigures.of(datums)  # type: ignore[arg-type]
        # Fewer samples than num_minibatches (groups lost samples) means fewer, non-empty minibatches.
        minibatches = [list(r) for r in split_even(len(figures), self.cfg.num_minibatches) if r]
        old = self.compute_logprobs(datums, minibatches, figures=figures) if len(minibatches) > 1 else None
        wants_ref = wants_reference_logprobs(self.cfg) and ref_by_sample is None and ref_future is None
        if wants_ref and self.reference_model is not None:
            # The colocated reference: a frozen copy sharded like the policy, in the same micro-batches.
            ref_by_sample = self.compute_logprobs(
                datums, minibatches, timer="ref_forward", figures=figures, model=self.reference_model
            )
        elif wants_ref and self.reference_context is not None:
            with self.reference_context():
                ref_by_sample = self.compute_logprobs(datums, minibatches, timer="ref_forward", figures=figures)
        if ref_by_sample is None and ref_future is not None:
            future = ref_future
            ref_by_sample = PendingRef(
                lambda: [torch.tensor(lp, dtype=torch.float32) for lp in future.result(REF_WAIT_TIMEOUT_S)],
                self.timers,
            )
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        for samples in minibatches:
            part = self.accumulate_gradients(
                datums, advantages, samples, old=old, ref_by_sample=ref_by_sample, figures=figures
            )
            norm = self.optimizer_step(finite_loss=math.isfinite(part["_loss"]))
            if norm is None:
                # A non-finite loss or gradient (e.g. absurd rewards in center mode, a bad sample): this and the
                # remaining minibatches are not applied, so no NaN reaches the weights or the replicas.
                return {"skipped_nonfinite": 1.0, mn.OPTIMIZER_STEPS: float(len(grad_norms))}
            for key, value in part.items():
                sums[key] = sums.get(key, 0.0) + value
            grad_norms.append(norm)
        # The minibatch sums were reduced over ranks; normalise once for the whole batch.
        tokens = max(sums.pop("_tokens"), 1.0)
        metrics = {
            mn.loss_metric_key(key.removeprefix("_tok/")): value / tokens
            for key, value in sums.items()
            if key.startswith("_tok/")
        }
        metrics[mn.LOSS] = sums["_loss"] / len(minibatches)
        metrics[mn.GRAD_NORM] = sum(grad_norms) / len(grad_norms)
        metrics[mn.OPTIMIZER_STEPS] = float(len(minibatches))
        return metrics

    def accumulate_gradients(
        self,
        datums: Sequence[Datum] | Mapping[int, Datum],
        advantages: torch.Tensor,
        samples: Sequence[int],
        *,
        old: Mapping[int, torch.Tensor] | None = None,
        ref_by_sample: RefRows | PendingRef | None = None,
        figures: SampleFigures | None = None,
    ) -> dict[str, float]:
        """Forward + backward of the minibatch `samples` (this rank's share); gradients accumulate.

        The gradient is that of the minibatch's loss as if it ran in one piece on one rank. Returns
        sums over all ranks: "_loss" (the minibatch loss), "_tokens" (its trainable tokens) and
        "_tok/<metric>" token-weighted sums of the loss metrics and the entropy.
        """
        started = time.perf_counter()
        if figures is None:  # every sample of `samples` is here
            figures = _figures_of(datums, samples)
        totals = figures.totals(samples)
        settings = self._loss_settings(figures.width(samples))
        world = self.ctx.world_size
        # Every figure stays on the device until the minibatch ends, then one read (one host sync per minibatch,
        # not several per micro-batch); token counts and loss scales come from the host's figures.
        on_device: dict[str, torch.Tensor] = {}
        tokens_total = 0.0

        def add(key: str, value: torch.Tensor) -> None:
            on_device[key] = on_device[key] + value if key in on_device else value

        for micro in self._my_micro_batches(samples, figures):
            batch, n, micro_datums = self._collate(datums, micro)
            mask = batch.mask_BT.to(self.device)
            logprobs, entropy = self._forward(batch, micro_datums, entropy=True)
            if isinstance(ref_by_sample, PendingRef):  # every rank, after its first forward (see PendingRef)
                ref_by_sample = ref_by_sample.get()
            width = logprobs.shape[1]
            old_BT = (
                _pad_rows([old[i] for i in micro], width).to(self.device)
                if old is not None and n
                else logprobs.detach()
            )
            ref_BT = (
                _pad_rows([ref_by_sample[i] for i in micro], width).to(self.device)
                if ref_by_sample is not None and n
                else None
            )
            adv = advantages[list(micro)].to(self.device) if n else torch.zeros(1, device=self.device)
            loss, loss_metrics = policy_loss_on_device(
                self.loss_name,
                logprobs,
                old_BT,
                batch.rollout_logprobs_BT.to(self.device),
                adv,
                mask,
                ref_logprobs=ref_BT if wants_reference_logprobs(self.cfg) else None,
                cfg=settings,
                versions=batch.versions_BT.to(self.device) if batch.versions_BT is not None else None,
                mask_values_checked=_mask_is_binary(micro_datums),
            )
            counts = [figures.trainable[i] for i in micro]  # each sequence's mask sum, known on the host
            scale = part_loss_scale_of_counts(settings.loss_agg_mode, counts, totals)
            # FSDP averages gradients over ranks; scaling by the world size turns that into a sum.
            (loss * (scale * world)).backward()
            tokens = float(sum(counts))
            tokens_total += tokens
            add("_loss", loss.detach().float() * scale)
            for key, value in loss_metrics.items():
                add(f"_tok/{key}", value.float() * tokens)
            assert entropy is not None
            add("_tok/entropy", (entropy.float() * mask).sum())
        names = sorted(on_device)
        values = torch.stack([on_device[k] for k in names]).tolist() if names else []  # the one host sync
        sums: dict[str, float] = {"_loss": 0.0, **dict(zip(names, values, strict=True)), "_tokens": tokens_total}
        keys = sorted(sums)
        reduced = fdist.all_reduce_sum([sums[k] for k in keys], self.ctx)
        self.timers["fwd_bwd"] = self.timers.get("fwd_bwd", 0.0) + time.perf_counter() - started
        return dict(zip(keys, reduced, strict=True))

    def optimizer_step(self, finite_loss: bool = True) -> float | None:
        """Clip, step AdamW and the LR schedule, clear grads; return the pre-clip grad norm. When the loss or the
        gradient norm is not finite, clear the grads without stepping and return None (every rank sees the same
        reduced loss and full norm, so every rank decides alike)."""
        started = time.perf_counter()
        max_norm = self.cfg.grad_clip_norm if self.cfg.grad_clip_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not (finite_loss and math.isfinite(float(norm))):
            self.optimizer.zero_grad(set_to_none=True)
            self.timers["optim"] = self.timers.get("optim", 0.0) + time.perf_counter() - started
            return None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.timers["optim"] = self.timers.get("optim", 0.0) + time.perf_counter() - started
        return float(norm)
