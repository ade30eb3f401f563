"""Fused kernels swapped into the policy's decoder: Liger's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy.

`liger_kernels` (docs/trainer.md "Kernels and compile"): `"auto"` (the default) swaps Liger's Triton kernels in on
CUDA when the `liger` extra (`liger-kernel`) is installed, `true` requires them (a start without CUDA or without the
package fails, naming the field), `false` keeps the model's own modules. The choice is logged once.

Four interfaces (`Kernels`), each with a pure-torch reference implementation (`TORCH_KERNELS`, the exact math of HF's
Llama/Qwen modules) and Liger's (`liger_kernels()`, its public functional API: `liger_rms_norm`, `liger_swiglu`,
`liger_rope`, `liger_fused_linear_cross_entropy`):

- `rms_norm(x, weight, eps)`: every `...RMSNorm` module's forward (float32 statistics, cast back, times weight).
- `swiglu(gate, up)`: `silu(gate) * up` inside every MLP (`down_proj(swiglu(gate_proj(x), up_proj(x)))`).
- `rotary(q, k, cos, sin)`: HF's `apply_rotary_pos_emb` of the model's modeling module (a module global, so the swap
  is process-wide, as Liger's own `apply_liger_kernel_to_*` does it; it dispatches on the tensors' device, so a CPU
  model in the same process keeps the original).
- `linear_logprobs(hidden, weight, bias, targets)`: the target logprobs of the vocabulary projection without the
  `[tokens, V]` logits ever existing whole: fleetrl's chunked logprob head (fleetrl.trainer.logprobs) calls it
  instead of its own chunk loop. Liger's fused linear cross-entropy (`reduction="none"`, the negated loss is the
  logprob; its backward recomputes the chunks' logits with each token's own upstream gradient) does the projection,
  the log-softmax and the gradient in one Triton pass per chunk. The sampling temperature divides the hidden states
  first ((h / T) W^T = (h W^T) / T). The entropy, a metric without gradient, stays fleetrl's own chunked no-grad pass.

The swap only replaces forwards on this model's instances (parameters and state-dict names unchanged, so FSDP2,
checkpoints, LoRA and the weight stream see the same model) and only for model types whose modules have exactly that
math (`SUPPORTED_MODEL_TYPES`); the head applies to any model the chunked head takes. Liger's kernels need a GPU: on
CPU the swap-in path is tested with `TORCH_KERNELS` (tests/unit/trainer/test_kernels.py: outputs and gradients
unchanged), and the GPU check compares Liger's against the model's own.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose RMSNorm, MLP and RoPE are the Llama ones (what the swapped kernels compute)."""
_KERNELS = "_fleetrl_kernels"


@dataclass(frozen=True)
class Kernels:
    """One implementation of each swapped op; `device_type` None = any device."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    linear_logprobs: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
    device_type: str | None = None


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's LlamaRMSNorm / Qwen2RMSNorm: statistics in float32, cast back before the weight (Zhang & Sennrich 2019).
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up  # Shazeer 2020, "GLU variants improve transformer"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # RoFormer (Su et al. 2021) in HF's rotate-half layout; q, k [B, heads, T, D], cos, sin [B, T, D].
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _torch_linear_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, targets_N: torch.Tensor
) -> torch.Tensor:
    logits = F.linear(hidden_NH, weight_VH, bias_V).float()
    return -F.cross_entropy(logits, targets_N, reduction="none")


TORCH_KERNELS = Kernels("torch", _torch_rms_norm, _torch_swiglu, _torch_rotary, _torch_linear_logprobs)
"""The reference implementations: the math of HF's own modules, in plain torch (what the wiring is tested with)."""


def liger_available() -> bool:
    """Whether the `liger` extra is installed (liger_kernel and the triton it needs), without importing it."""
    return importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None


def liger_kernels() -> Kernels:
    """Liger's Triton kernels through its public functional API (CUDA only)."""
    from liger_kernel.transformers.functional import (
        liger_fused_linear_cross_entropy,
        liger_rms_norm,
        liger_rope,
        liger_swiglu,
    )

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # casting_mode "llama" is HF's Llama/Qwen cast order; not in place: the upstream gradient may be shared.
        return liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)

    def rotary(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return liger_rope(q, k, cos, sin)

    def linear_logprobs(
        hidden_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, targets_N: torch.Tensor
    ) -> torch.Tensor:
        # ignore_index -1: no target is ever ignored (token ids are >= 0); float32 accumulation of the weight's
        # gradient chunk by chunk, as the chunked head's float32 logits give.
        loss_N = liger_fused_linear_cross_entropy(
            hidden_NH, weight_VH, targets_N, bias_V, ignore_index=-1, reduction="none", accum_dtype=torch.float32
        )
        return -loss_N.float()

    return Kernels("liger", rms_norm, liger_swiglu, rotary, linear_logprobs, device_type="cuda")


def choose_kernels(setting: bool | str, device: torch.device) -> Kernels | None:
    """The kernels `liger_kernels = setting` gives on `device`: Liger's or None (the model's own modules).

    "auto": Liger on CUDA when installed. True: Liger, or a ValueError naming the field when there is no CUDA
    device or no package. False: None."""
    if setting is False or setting == "false":
        return None
    if setting not in (True, "auto", "true"):
        raise ValueError(f"liger_kernels must be true, false or 'auto', got {setting!r}")
    required = setting is True or setting == "true"
    if device.type != "cuda":
        if required:
            raise ValueError(
                f"liger_kernels = true: Liger's Triton kernels need a CUDA device, the trainer is on {device}"
            )
        return None
    if not liger_available():
        if required:
            raise ValueError("liger_kernels = true: liger-kernel is not installed (pip install 'fleetrl[liger]')")
        return None
    return liger_kernels()


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _is_swiglu_mlp(module: torch.nn.Module, hidden_act: str | None) -> bool:
    return hidden_act in ("silu", "swish") and all(
        isinstance(getattr(module, name, None), torch.nn.Module) for name in ("gate_proj", "up_proj", "down_proj")
    )


class _RMSNormForward:
    def __init__(self, module: torch.nn.Module, kernel: Callable[..., torch.Tensor]) -> None:
        self.module, self.kernel = module, kernel

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.kernel(hidden_states, self.module.weight, self.module.variance_epsilon)


class _SwiGLUForward:
    def __init__(self, module: torch.nn.Module, kernel: Callable[..., torch.Tensor]) -> None:
        self.module, self.kernel = module, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        return m.down_proj(self.kernel(m.gate_proj(x), m.up_proj(x)))


class _RotaryDispatch:
    """The modeling module's `apply_rotary_pos_emb`: the kernel for tensors on its device, else the original."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.by_device: dict[str | None, Callable[..., Any]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kw: Any):
        kernel = self.by_device.get(q.device.type) or self.by_device.get(None)
        if kernel is None or args or kw:  # a call shape the kernels do not take (unsqueeze_dim != 1): HF's own
            return self.original(q, k, cos, sin, *args, **kw)
        return kernel(q, k, cos, sin)


def _swap_rotary(model: torch.nn.Module, kernels: Kernels) -> bool:
    attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)
    modeling = sys.modules.get(type(attention).__module__) if attention is not None else None
    current = getattr(modeling, "apply_rotary_pos_emb", None)
    if current is None:
        return False
    if not isinstance(current, _RotaryDispatch):
        current = _RotaryDispatch(current)
        modeling.apply_rotary_pos_emb = current  # type: ignore[union-attr]
    current.by_device[kernels.device_type] = kernels.rotary
    return True


def swap_in(model: torch.nn.Module, kernels: Kernels) -> dict[str, int]:
    """Swap `kernels` into `model` (an HF causal LM or a PEFT model around one); returns what was swapped, by op.

    Call it before sharding or compiling (it replaces instance forwards); parameters stay where they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    model_type = getattr(config, "model_type", None)
    swapped = {"rms_norm": 0, "swiglu": 0, "rotary": 0, "linear_logprobs": 1}
    if model_type in SUPPORTED_MODEL_TYPES:
        hidden_act = getattr(config, "hidden_act", None)
        for module in base.modules():
            if _is_rms_norm(module):
                module.forward = _RMSNormForward(module, kernels.rms_norm)  # type: ignore[method-assign]
                swapped["rms_norm"] += 1
            elif _is_swiglu_mlp(module, hidden_act):
                module.forward = _SwiGLUForward(module, kernels.swiglu)  # type: ignore[method-assign]
                swapped["swiglu"] += 1
        swapped["rotary"] = int(_swap_rotary(base, kernels))
    else:
        logger.info(
            "kernels %s: model type %r has no swappable modules; only the logprob head", kernels.name, model_type
        )
    setattr(base, _KERNELS, kernels)
    return swapped


def model_kernels(model: torch.nn.Module) -> Kernels | None:
    """The kernels swapped into `model` (or the model a PEFT model wraps), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, _KERNELS, None)
