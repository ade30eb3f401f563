"""Variable-length attention for packed rows: each sample attends causally to itself only, at the cost of its own
length squared.

transformers finds the samples of a packed row from its position ids. With flash-attention 2 it runs the
variable-length kernel (`flash_attn_varlen_func`): the trainer uses it on CUDA when the `flash_attn` package is
installed. Without it, sdpa and eager build a block-diagonal [N, N] mask and compute attention over the whole row:
(sum of lengths)^2 instead of the sum of the squares (on a 4096-token sample packed with a few hundred short ones,
several times the work, and an N x N mask in memory). `varlen_sdpa` is the fallback that computes only what is
needed. On CUDA in bf16/fp16, for a row of many samples (KERNEL_MIN_SAMPLES), it runs PyTorch's own variable-length
flash kernel (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10) once over the whole row. Otherwise on CUDA
(few long samples, fp32, older torch) it runs `scaled_dot_product_attention(is_causal=True)` per sample; on CPU one
causal sdpa call per length bucket, the bucket's samples padded to its longest (`_bucketed_sdpa`: per-call dispatch
made the per-sample loop several times slower there for rows of many short samples). No mask at all either way; the
rule is `choose_packed_attention`, measured and explained in docs/trainer.md ("Which path runs on which device").
The samples' bounds come from `cu_seq_lens_q` / `max_length_q`, which the trainer passes with the forward
(`fleetrl.trainer.logprobs.packed_logprobs`, transformers' flash-attention kwargs, computed once per forward on the
host), else from the position ids (each 0 starts a sample). A batch that is not one packed row (padded rows, or a
mask given) goes to transformers' own sdpa unchanged.

On an H100 (bench/gpu_check.py) the per-sample loop first found the bounds from device position ids in every layer,
a host sync per layer; the bounds now come from the host.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

VARLEN_SDPA = "fleetrl_varlen_sdpa"


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query/key/value `[B, heads, T, D]` in, `[B, T, heads, D]` out."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    one_row = attention_mask is None and query.shape[0] == 1 and query.shape[2] > 1
    if not one_row or (cu_seq_lens is None and position_ids is None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    length = query.shape[2]
    if cu_seq_lens is not None:
        samples = int(cu_seq_lens.numel()) - 1
        if _forced_path in (None, VARLEN_KERNEL) and use_varlen_kernel(query, dropout, samples):
            _note_choice(VARLEN_KERNEL, query.device.type)
            max_length = int(kwargs.get("max_length_q") or length)
            return _varlen_kernel(query, key, value, cu_seq_lens, max_length, scaling).unsqueeze(0), None
        bounds = [int(b) for b in cu_seq_lens.tolist()]  # host-side bounds: no device sync
    else:
        starts = torch.nonzero(position_ids.reshape(-1)[:length] == 0).flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        bounds = [*starts, length]
    forced = _forced_path if _forced_path != VARLEN_KERNEL else None
    path = forced or choose_packed_attention(query.device.type, len(bounds) - 1, kernel=False)
    _note_choice(path, query.device.type)
    if path == BUCKETED:
        return _bucketed_sdpa(query, key, value, bounds, dropout, scaling), None
    if path == BLOCK_MASK:
        return _block_mask_sdpa(query, key, value, bounds, dropout, scaling), None
    return _per_sample_sdpa(query, key, value, bounds, dropout, scaling), None


def _per_sample_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Causal sdpa over each sample `bounds[i]:bounds[i+1]` of a packed row: `[1, heads, N, D]` in, `[1, N, heads, D]`
    out."""
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            is_causal=True,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _bucket_of(length: int) -> int:
    """A sample's length bucket: the next power of two (samples of one bucket are padded to its longest, so a
    padded sample is never more than twice its length and its attention never more than 4x its own)."""
    return 1 << max(0, length - 1).bit_length()


@dataclass(frozen=True)
class _BucketPlan:
    """How `_bucketed_sdpa` lays out one packed row: per bucket, either one sample's bounds (a slice, no copy) or
    the gather indices of its samples padded to `[count, longest]`; then where the buckets' tokens go back."""

    parts: tuple[tuple[int, int] | tuple[torch.Tensor, torch.Tensor, int, int], ...]
    restore: torch.Tensor | None  # positions of the concatenated outputs in row order; None: already in order


@functools.lru_cache(maxsize=8)
def _bucket_plan(bounds: tuple[int, ...], device: torch.device) -> _BucketPlan:
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > 0:
            buckets.setdefault(_bucket_of(n), []).append(i)
    parts: list[Any] = []
    order: list[torch.Tensor] = []
    for key in sorted(buckets):
        members = buckets[key]
        if len(members) == 1:
            start, end = bounds[members[0]], bounds[members[0] + 1]
            parts.append((start, end))
            order.append(torch.arange(start, end))
            continue
        starts = torch.tensor([bounds[i] for i in members])
        sizes = torch.tensor([lengths[i] for i in members])
        longest = int(sizes.max())
        steps = torch.arange(longest)
        valid_BL = steps.unsqueeze(0) < sizes.unsqueeze(1)
        # A padding slot reads its sample's first token: any real position will do, since under the causal mask
        # real positions never attend to the slots after them and the slots' outputs are dropped.
        index_BL = torch.where(valid_BL, starts.unsqueeze(1) + steps, starts.unsqueeze(1))
        keep = torch.nonzero(valid_BL.flatten()).flatten()
        parts.append((index_BL.flatten().to(device), keep.to(device), len(members), longest))
        order.append(index_BL.flatten()[keep])
    flat = torch.cat(order)
    in_order = bool(torch.equal(flat, torch.arange(flat.numel())))
    restore = None if in_order else torch.argsort(flat).to(device)
    return _BucketPlan(tuple(parts), restore)


def _bucketed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Causal sdpa over the samples of a packed row, one call per length bucket (`_bucket_of`): a bucket's samples
    are gathered into a right-padded batch `[count, heads, longest, D]` and run as one causal attention, the padding
    slots' outputs dropped. `[1, heads, N, D]` in, `[1, N, heads, D]` out. A bucket of one sample is a slice."""
    plan = _bucket_plan(tuple(bounds), query.device)
    gqa = key.shape[1] != query.shape[1]
    q_HND, k_HND, v_HND = query[0], key[0], value[0]
    outs: list[torch.Tensor] = []
    for part in plan.parts:
        if len(part) == 2:
            start, end = part  # type: ignore[misc]
            q, k, v = (t[:, start:end].unsqueeze(0) for t in (q_HND, k_HND, v_HND))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
            outs.append(out[0].transpose(0, 1))  # [n, heads, D]
            continue
        index, keep, count, longest = part  # type: ignore[misc]
        q, k, v = (
            t.index_select(1, index).unflatten(1, (count, longest)).transpose(0, 1) for t in (q_HND, k_HND, v_HND)
        )
        out_BHLD = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
        out_ND = out_BHLD.transpose(1, 2).reshape(count * longest, *out_BHLD.shape[1:2], out_BHLD.shape[-1])
        outs.append(out_ND.index_select(0, keep))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)
    return out.unsqueeze(0).contiguous()


def _block_mask_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """One sdpa call over the whole row under a block-diagonal causal mask `[N, N]` (the work of the row's length
    squared; measured for comparison, bench/trainer_packing.py paths). `[1, heads, N, D]` in, `[1, N, heads, D]`
    out."""
    n = query.shape[2]
    sample = torch.repeat_interleave(
        torch.arange(len(bounds) - 1), torch.tensor([e - s for s, e in itertools.pairwise(bounds)])
    ).to(query.device)
    position = torch.arange(n, device=query.device)
    mask = (sample.unsqueeze(1) == sample.unsqueeze(0)) & (position.unsqueeze(1) >= position.unsqueeze(0))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous()


def _torch_varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


# Packed rows with at least this many samples go through torch's varlen kernel on CUDA; fewer, longer samples
# through the per-sample loop. Measured on an H100 (torch 2.11, bf16, 12 heads, 2 kv heads, dim 128; forward and
# backward): samples [4096, 256, 4096, 256]: loop 2.01 ms, kernel 2.44 ms; 32 x 256: loop 8.07 ms (a launch per
# sample per layer), kernel 1.33 ms. 8 lies between the two measured points (docs/benchmarks.md, GPU check).
KERNEL_MIN_SAMPLES = 8


def use_varlen_kernel(query: torch.Tensor, dropout: float = 0.0, samples: int | None = None) -> bool:
    """Whether PyTorch's variable-length flash kernel serves `query` (a packed row of `samples` samples): CUDA, bf16
    or fp16, no dropout, torch >= 2.10, and at least KERNEL_MIN_SAMPLES samples."""
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and dropout == 0.0
        and (samples is None or samples >= KERNEL_MIN_SAMPLES)
        and _torch_varlen() is not None
    )


VARLEN_KERNEL = "varlen_kernel"
SAMPLE_LOOP = "sample_loop"
BUCKETED = "bucketed_sdpa"
BLOCK_MASK = "block_mask_sdpa"
PACKED_PATHS = (VARLEN_KERNEL, SAMPLE_LOOP, BUCKETED, BLOCK_MASK)
"""How `varlen_sdpa` computes a packed row's attention: torch's varlen flash kernel in one call; one sdpa call per
sample; one sdpa call per length bucket over its samples padded (`_bucketed_sdpa`); one sdpa call over the whole row
under a block-diagonal mask (benchmarks only: the row's length squared)."""


def choose_packed_attention(device_type: str, samples: int, *, kernel: bool) -> str:
    """The attention path for a packed row of `samples` samples on a `device_type` device (`kernel`: torch's varlen
    kernel serves it, `use_varlen_kernel`). The rule and the measurements behind it are in docs/trainer.md ("Which
    path runs on which device"):

    - the varlen kernel where it serves (CUDA, bf16/fp16, >= KERNEL_MIN_SAMPLES samples): one launch per layer;
    - on CUDA otherwise, the per-sample loop, as measured on an H100 for a few long samples (no GPU measurement of
      the bucketed path yet, so CUDA keeps what it had);
    - elsewhere (CPU) the bucketed path: on CPU each sdpa call costs ~40 us of dispatch forward and backward, so the
      per-sample loop made a row of 128 short samples ~3x slower than padded rows; the bucketed path calls sdpa
      once per length bucket (one call for the main job's rows), and for a few long samples in distinct buckets it
      is the per-sample loop's slices."""
    if kernel:
        return VARLEN_KERNEL
    if device_type == "cuda":
        return SAMPLE_LOOP
    del samples
    return BUCKETED


_forced_path: str | None = None
_logged: set[tuple[str, str]] = set()


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Every packed row in the block takes `path` (one of PACKED_PATHS) instead of the rule's choice: for benchmarks
    and tests comparing the paths. VARLEN_KERNEL still needs the kernel; where it does not serve, the rule decides."""
    global _forced_path
    if path not in PACKED_PATHS:
        raise ValueError(f"packed attention path must be one of {PACKED_PATHS}, got {path!r}")
    previous, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = previous


def _note_choice(path: str, device_type: str) -> None:
    """Log the attention path the first time it runs on a device type (once per process and pair)."""
    if (path, device_type) not in _logged:
        _logged.add((path, device_type))
        logger.info("packed attention on %s: %s (docs/trainer.md, which path runs on which device)", device_type, path)


def describe_choice(dtype: torch.dtype, device: torch.device | str) -> str:
    """Which path `varlen_sdpa` takes for packed rows of `dtype` on `device`, in words."""
    probe = torch.empty(1, dtype=dtype, device=device)
    fallback = choose_packed_attention(probe.device.type, 1, kernel=False)
    words = {SAMPLE_LOOP: "the per-sample sdpa loop", BUCKETED: "one sdpa call per length bucket"}[fallback]
    if not use_varlen_kernel(probe):
        return words
    return f"torch varlen_attn for rows of {KERNEL_MIN_SAMPLES} or more samples, else {words}"


def _varlen_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: float | None,
) -> torch.Tensor:
    """One causal flash-attention call over a packed row: query/key/value `[1, heads, N, D]` in, `[N, heads, D]` out."""
    varlen_attn = _torch_varlen()
    params = inspect.signature(varlen_attn).parameters
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
    extra: dict[str, Any] = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if "window_size" in params:  # torch >= 2.11
        extra["window_size"] = (-1, 0)
    else:  # torch 2.10
        extra["is_causal"] = True
    if scaling is not None and "scale" in params:
        extra["scale"] = scaling
    cu = cu_seq_lens.to(device=q.device, dtype=torch.int32, non_blocking=True)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_length, max_length, **extra)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa)


def packed_attention(device: torch.device) -> str:
    """The attention implementation for packed rows on `device`: flash-attention 2 on CUDA where installed, else
    `varlen_sdpa`."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_SDPA


def use_packed_attention(model: torch.nn.Module, device: torch.device) -> str:
    """Switch `model` (an HF model, or a PEFT / FSDP-wrapped one) to variable-length attention for packed rows;
    returns the implementation's name. A model whose attention does not follow transformers' AttentionInterface
    keeps its own (with sdpa or eager, transformers still masks packed rows correctly, only at full cost)."""
    _register()
    name = packed_attention(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    setter = getattr(base, "set_attn_implementation", None)
    if setter is None:
        return str(getattr(getattr(base, "config", None), "_attn_implementation", "unknown"))
    try:
        setter(name)
    except (ValueError, ImportError) as exc:
        kept = base.config._attn_implementation
        logger.warning("packed attention: %s is not usable here (%s); keeping %s", name, exc, kept)
    return str(base.config._attn_implementation)
