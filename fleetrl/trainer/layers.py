"""Per-decoder-layer training options: which activations are recomputed in backward, and `torch.compile` per block.

Activation checkpointing (`gradient_checkpointing`, `gradient_checkpointing_every`, `gradient_checkpointing_scope`;
docs/trainer.md "Activation checkpointing") recomputes activations in backward instead of keeping them from forward:

- scope `"layer"` (the default): the whole decoder layer (HF's `GradientCheckpointingLayer`, non-reentrant); a layer
  keeps only its input `[tokens, hidden]` from forward and recomputes everything inside it in backward.
- scope `"attention"`: only the attention sublayer (its projections, RoPE and the attention itself) is recomputed; the
  MLP keeps its intermediates. Cheaper recomputation (the attention is about a third of a layer's matmul FLOPs at
  Qwen shapes), less saving.
- scope `"mlp"`: only the MLP (gate, up, activation, down) is recomputed: its intermediates (3 x intermediate_size
  per token) are most of a layer's activation memory, its recomputation the larger share of the FLOPs.
- `every = k`: only layers 0, k, 2k, ... are checkpointed (Megatron's and torchtitan's "every k-th layer" selective
  checkpointing), the others keep everything: between no checkpointing (k larger than the depth) and all layers (1).

Checkpointing is installed once (`install_checkpointing`) and switched per forward (`set_checkpointing`, as
`gradient_checkpointing = "auto"` does by micro-batch size). Recomputation is exact (the same ops on the same
inputs), so losses and gradients equal those without it (tests/unit/trainer/test_layers.py).

`compile_layers` compiles each decoder layer on its own (`nn.Module.compile`, torchtitan's per-block compile): one
graph per layer shape is reused by every layer, so compile time does not grow with depth, and FSDP2's per-layer
hooks stay outside the compiled code. Installed after the kernels and the checkpointing, so the compiled graph is
of the forward the layer will run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

CheckpointScope = Literal["layer", "attention", "mlp"]
SCOPES: tuple[str, ...] = ("layer", "attention", "mlp")
_SUBLAYER = {"attention": "self_attn", "mlp": "mlp"}
_PLAN = "_fleetrl_checkpoint_plan"


@dataclass(frozen=True)
class CheckpointPlan:
    """What is recomputed in backward when checkpointing is on: `scope` of every `every`-th decoder layer."""

    every: int = 1
    scope: CheckpointScope = "layer"

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"gradient_checkpointing_every must be >= 1, got {self.every}")
        if self.scope not in SCOPES:
            raise ValueError(f"gradient_checkpointing_scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")

    def chosen(self, index: int) -> bool:
        """Whether decoder layer `index` is checkpointed."""
        return index % self.every == 0


def decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (model.model.layers for Llama/Qwen-style); a PEFT
    model's are those of the model it wraps. Empty when the model has no such list."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    return list(layers) if layers is not None else []


class _Recompute:
    """A sublayer's forward, recomputed in backward while `on` (non-reentrant checkpoint, which works with FSDP2 and
    with inputs that need no grad)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.on = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on and torch.is_grad_enabled():
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return self.forward(*args, **kwargs)


def install_checkpointing(model: torch.nn.Module, plan: CheckpointPlan) -> None:
    """Prepare `model`'s decoder layers for `plan` and turn checkpointing on (`set_checkpointing` switches it)."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("gradient_checkpointing: the model has no decoder layer list to checkpoint")
    if plan.scope == "layer":
        # Non-reentrant checkpointing works with FSDP2 and with inputs that need no grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        name = _SUBLAYER[plan.scope]
        for index, layer in enumerate(layers):
            sub = getattr(layer, name, None)
            if not isinstance(sub, torch.nn.Module):
                raise ValueError(
                    f"gradient_checkpointing_scope = {plan.scope!r}: decoder layer {index} has no {name} module"
                )
            if not isinstance(sub.forward, _Recompute):
                sub.forward = _Recompute(sub.forward)  # type: ignore[method-assign]
    setattr(model, _PLAN, plan)
    set_checkpointing(model, True)


def set_checkpointing(model: torch.nn.Module, on: bool) -> int:
    """Turn the installed checkpointing on or off for the next forwards; returns how many layers (or sublayers) are
    now checkpointed. A model without `install_checkpointing` has whole-layer checkpointing of every layer when HF's
    `gradient_checkpointing_enable` prepared it, else nothing to switch (0)."""
    plan: CheckpointPlan | None = getattr(model, _PLAN, None)
    if plan is None and hasattr(model, "get_base_model"):
        plan = getattr(model.get_base_model(), _PLAN, None)
    plan = plan or CheckpointPlan()
    count = 0
    for index, layer in enumerate(decoder_layers(model)):
        chosen = on and plan.chosen(index)
        if plan.scope == "layer":
            if not hasattr(layer, "_gradient_checkpointing_func"):
                continue
            layer.gradient_checkpointing = chosen
        else:
            forward = getattr(getattr(layer, _SUBLAYER[plan.scope], None), "forward", None)
            if not isinstance(forward, _Recompute):
                continue
            forward.on = chosen
        count += int(chosen)
    return count


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer on its own (`nn.Module.compile`); returns how many. The graph is built at the
    first forward (and again for new shapes: dynamo then marks the varying dimensions dynamic)."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("compile_layers: the model has no decoder layer list to compile")
    for layer in layers:
        layer.compile()
    return len(layers)
