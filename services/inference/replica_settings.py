"""A vLLM replica's device-dependent settings, and the start-up check that its KV cache holds one sequence.

Pure logic (no vLLM, no torch): `engine_settings` turns what the config left unset into what the device wants,
and `check_kv_fits` refuses, before any engine process starts, a replica whose KV cache cannot hold one sequence of
`max_model_len` tokens, naming the setting to change (vLLM's own check says so only in its engine-core process's
log, in its own option names, after the model has loaded).

| setting | unset on GPU | unset on CPU |
| --- | --- | --- |
| `dtype` | bfloat16 | float32 (exact logprobs) |
| KV cache size | the rest of `gpu_memory_utilization` (0.9) | `VLLM_CPU_KVCACHE_SPACE` GiB if set, else 1 GiB |
| `enforce_eager` | False: CUDA graphs | True: no torch.compile (fast start) |
| `max_model_len` | the model's own | the model's own |

`kv_cache_gib` set: exactly that many GiB per rank on either device (vLLM's `kv_cache_memory_bytes`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_GIB = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ReplicaSettingsError(ValueError):
    """A replica that cannot start with its settings; the message names the setting to change."""


@dataclass(frozen=True)
class EngineSettings:
    """What a vLLM engine starts with, every device default resolved."""

    dtype: str
    enforce_eager: bool
    kv_cache_bytes: int | None  # vLLM's kv_cache_memory_bytes per rank; None: sized from gpu_memory_utilization
    kv_cache_setting: str  # the setting that sized the KV cache (named by a refusal)
    gpu_memory_utilization: float | None  # GPU only


def engine_settings(
    *,
    on_gpu: bool,
    dtype: str | None = None,
    enforce_eager: bool | None = None,
    kv_cache_gib: float | None = None,
    gpu_memory_utilization: float | None = None,
    environ: dict[str, str] | None = None,
) -> EngineSettings:
    """The settings of a replica on a GPU (`on_gpu`) or a CPU, each left None taking the device's default (the
    module docstring's table). `environ`: the process environment (for VLLM_CPU_KVCACHE_SPACE on CPU)."""
    if kv_cache_gib is not None and not kv_cache_gib > 0:
        raise ReplicaSettingsError(f"kv_cache_gib must be positive or unset, got {kv_cache_gib}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ReplicaSettingsError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ReplicaSettingsError(f"dtype must be one of {sorted(DTYPE_BYTES)} or unset, got {dtype!r}")
    if on_gpu:
        kv_bytes = None if kv_cache_gib is None else int(kv_cache_gib * GIB)
        return EngineSettings(
            dtype=dtype or "bfloat16",
            enforce_eager=False if enforce_eager is None else enforce_eager,
            kv_cache_bytes=kv_bytes,
            kv_cache_setting="gpu_memory_utilization" if kv_bytes is None else "kv_cache_gib",
            gpu_memory_utilization=gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        )
    setting, gib = "kv_cache_gib", kv_cache_gib
    space = (environ or {}).get(CPU_KV_SPACE_ENV, "")
    if gib is None and space.strip() not in ("", "0"):
        try:
            setting, gib = CPU_KV_SPACE_ENV, float(space)
        except ValueError:
            raise ReplicaSettingsError(f"{CPU_KV_SPACE_ENV} must be a number of GiB, got {space!r}") from None
    if gib is None:
        gib = DEFAULT_CPU_KV_CACHE_GIB
    return EngineSettings(
        dtype=dtype or "float32",
        enforce_eager=True if enforce_eager is None else enforce_eager,
        kv_cache_bytes=int(gib * GIB),
        kv_cache_setting=setting,
        gpu_memory_utilization=None,
    )


@dataclass(frozen=True)
class KVShape:
    """A model's KV cache per token on one tensor-parallel rank (plain full attention: every layer keeps K and V of
    `kv_heads` heads of `head_dim` for every token)."""

    layers: int
    kv_heads: int  # on one rank
    head_dim: int

    def bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def check_kv_fits(
    shape: KVShape,
    *,
    max_model_len: int,
    dtype: str,
    settings: EngineSettings,
    device_bytes: int | None = None,
    weight_bytes: int = 0,
) -> None:
    """Raise ReplicaSettingsError, naming the setting to change, when the KV cache of one rank cannot hold one
    sequence of `max_model_len` tokens. With a fixed size (`settings.kv_cache_bytes`) the check is exact (up to
    vLLM's block rounding); sized from `gpu_memory_utilization` of `device_bytes`, the KV cache gets at most that
    share less `weight_bytes` (one rank's weights; activations take more), so a refusal here is certain and vLLM's
    own check catches the rest."""
    per_token = shape.bytes_per_token(dtype)
    need = per_token * max_model_len
    if settings.kv_cache_bytes is not None:
        have = settings.kv_cache_bytes
        if need <= have:
            return
        fits = have // per_token
        raise ReplicaSettingsError(
            f"the KV cache ({settings.kv_cache_setting} = {have / GIB:.4g} GiB per rank) holds {fits} tokens of this "
            f"model ({per_token} bytes per token per rank in {dtype}), less than one sequence of max_model_len = "
            f"{max_model_len}: raise {settings.kv_cache_setting} to at least {math.ceil(need / GIB * 1e4) / 1e4:g} "
            f"or cap max_model_len at {fits}"
        )
    if device_bytes is None or settings.gpu_memory_utilization is None:
        return
    budget = int(device_bytes * settings.gpu_memory_utilization) - weight_bytes
    if need <= budget:
        return
    fits = max(budget, 0) // per_token
    raise ReplicaSettingsError(
        f"gpu_memory_utilization = {settings.gpu_memory_utilization:g} of the GPU's {device_bytes / GIB:.1f} GiB "
        f"leaves at most {max(budget, 0) / GIB:.2f} GiB for the KV cache after {weight_bytes / GIB:.2f} GiB of "
        f"weights per rank, less than one sequence of max_model_len = {max_model_len} needs "
        f"({need / GIB:.2f} GiB at {per_token} bytes per token per rank in {dtype}): raise gpu_memory_utilization, "
        f"cap max_model_len at {fits} or less, or spread the model over more GPUs (tensor_parallel_size)"
    )


def checkpoint_parameters(model_dir: str | Path) -> int:
    """The number of elements in a model directory's safetensors files (read from their headers; 0 if none)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total
