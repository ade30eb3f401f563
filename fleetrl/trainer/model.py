"""Loading the policy (any HF causal LM by path), its training options, and its per-token logprob forward.

The forward is the one place logprobs are computed for training, for the reference service and for the
benchmarks, so all three agree to the last bit on the same weights and batch.

`ModelOptions` is what the trainer does to the loaded model before sharding it, in this order: swap in fused kernels
(fleetrl.trainer.kernels), install activation checkpointing (fleetrl.trainer.layers: whole layers, every k-th, or
attention / MLP only), compile each decoder layer. `model_options(cfg, device)` reads them from the run config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from fleetrl.model_path import adapter_instead_of_model, check_model_path
from fleetrl.trainer.datum import gather_target_logprobs, shift_tokens
from fleetrl.trainer.kernels import Kernels, choose_kernels, swap_in
from fleetrl.trainer.layers import CheckpointPlan, compile_layers, install_checkpointing

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


@dataclass(frozen=True)
class ModelOptions:
    """What is done to a trainable model after loading and before sharding (see the module docstring)."""

    checkpointing: CheckpointPlan | None = None  # None: activations kept
    kernels: Kernels | None = None  # None: the model's own modules
    compile_layers: bool = False

    def with_checkpointing(self, on: bool) -> ModelOptions:
        """These options with whole-layer checkpointing of every layer when `on` and none is set."""
        if not on or self.checkpointing is not None:
            return self
        return ModelOptions(CheckpointPlan(), self.kernels, self.compile_layers)


def model_options(cfg: Any, device: torch.device) -> ModelOptions:
    """The run config's model options on `device` (fields absent from `cfg` take their defaults); logs them once.
    `liger_kernels = true` without CUDA or the package raises, naming the field."""
    checkpointing = getattr(cfg, "gradient_checkpointing", False)
    plan = (
        CheckpointPlan(
            every=int(getattr(cfg, "gradient_checkpointing_every", 1)),
            scope=getattr(cfg, "gradient_checkpointing_scope", "layer"),
        )
        if checkpointing
        else None
    )
    liger = getattr(cfg, "liger_kernels", "auto")
    kernels = choose_kernels(liger, device)
    options = ModelOptions(plan, kernels, bool(getattr(cfg, "compile_layers", False)))
    logger.info(
        "model options on %s: kernels %s, activation checkpointing %s, compile per layer %s",
        device.type,
        "liger" if kernels is not None else f"the model's own (liger_kernels = {liger})",
        "off" if plan is None else f"{plan.scope} of every {plan.every} layer(s) ({checkpointing})",
        "on" if options.compile_layers else "off",
    )
    return options


def apply_model_options(model: torch.nn.Module, options: ModelOptions) -> torch.nn.Module:
    """Swap in the kernels, install the checkpointing, compile the layers (in that order: the compiled graph is of
    the forward the layer will run); returns `model`."""
    if options.kernels is not None:
        swapped = swap_in(model, options.kernels)
        logger.info("kernels %s swapped in: %s", options.kernels.name, swapped)
    if options.checkpointing is not None:
        install_checkpointing(model, options.checkpointing)
    if options.compile_layers:
        logger.info("torch.compile: %d decoder layers", compile_layers(model))
    return model


def load_causal_lm(
    path: str,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    device: str | torch.device = "cpu",
    trainable: bool = True,
    options: ModelOptions | None = None,
) -> torch.nn.Module:
    """Load an HF causal LM from a local path or hub id, in `dtype`, on `device`.

    trainable=False gives a frozen eval-mode copy (the reference policy): no grads, never stepped. A trainable
    model gets `options` (`gradient_checkpointing` adds whole-layer checkpointing when they set none).
    """
    from transformers import AutoModelForCausalLM

    if not path:
        raise ValueError("base_model is empty: give the path (or hub id) of an HF causal LM")
    adapter = adapter_instead_of_model(path)
    if adapter is not None:
        raise ValueError(f"base_model: {adapter}")
    check_model_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    except OSError as exc:
        raise ValueError(f"cannot load an HF causal LM from {path!r}: {exc}") from exc
    model.to(device)
    # The trainer never decodes incrementally; a KV cache would only cost memory.
    model.config.use_cache = False
    if trainable:
        model.train()
        apply_model_options(model, (options or ModelOptions()).with_checkpointing(bool(gradient_checkpointing)))
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    check_model_path(path)
    return AutoTokenizer.from_pretrained(path)


def pad_token_id(model: torch.nn.Module, tokenizer: Any = None) -> int:
    """A token id for right padding (never attended to by real positions, never a target with weight)."""
    for source in (getattr(tokenizer, "pad_token_id", None), model.config.pad_token_id):
        if isinstance(source, int):
            return source
    eos = model.config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else 0


def forward_logits(model: torch.nn.Module, input_tokens_BT: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of a right-padded batch.

    No attention mask is passed on purpose: with right padding and a causal mask, a real position
    only attends to earlier positions, which are all real, so the mask changes nothing at real
    positions while its absence lets attention use the fused causal kernel.
    """
    return model(input_ids=input_tokens_BT, use_cache=False).logits


def target_logprobs(
    model: torch.nn.Module,
    input_tokens_BT: torch.Tensor,
    target_tokens_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy_mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target-aligned logprobs [B, T] (float32) and, when `entropy_mask_BT` is given, the entropy.

    Logits are divided by the sampling temperature, so these logprobs are of the distribution the
    sampler drew from (the inference server reports logprobs after temperature too). Entropy is of
    that same distribution, computed without gradient and only where the mask is 1 (it is a metric,
    and the masked rows are usually a fraction of the batch).
    """
    logits_BTV = forward_logits(model, input_tokens_BT)
    if temperature != 1.0:
        logits_BTV = logits_BTV.float() / temperature
    if entropy_mask_BT is None:
        return gather_target_logprobs(logits_BTV, target_tokens_BT), None
    # gather_target_logprobs' two steps, inline so the entropy reuses the same log-softmax (one pass
    # over [B, T, V] instead of two).
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    logprobs_BT = logp_BTV.gather(-1, target_tokens_BT.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        keep = entropy_mask_BT.bool()
        entropy_BT = torch.zeros_like(logprobs_BT)
        if bool(keep.any()):
            logp_NV = logp_BTV.detach()[keep]
            entropy_BT[keep] = -(logp_NV.exp() * logp_NV).sum(-1)
    return logprobs_BT, entropy_BT


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    sequences: list[list[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    device: str | torch.device = "cpu",
    chunk_tokens: int = 1024,
) -> list[list[float]]:
    """Per-token logprobs of each sequence (N-1 per N tokens), one packed forward for the lot (no padding; logprobs
    `chunk_tokens` positions at a time, fleetrl.trainer.logprobs). `pad_id` is unused (kept for callers)."""
    from fleetrl.trainer.logprobs import pack, packed_logprobs

    del pad_id
    if not sequences:
        return []
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequence {i} has {len(seq)} tokens; at least 2 are needed")
    inputs, targets = zip(*(shift_tokens(s) for s in sequences), strict=True)
    packed = pack(inputs, targets).to(device)
    logprobs_N, _ = packed_logprobs(model, packed, temperature=temperature, chunk_tokens=chunk_tokens)
    return [row.tolist() for row in logprobs_N.float().cpu().split(packed.lengths)]
