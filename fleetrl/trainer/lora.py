"""LoRA on the policy (PEFT): wrap the loaded model, name its adapter, and read the adapter back out.

    model = wrap_with_lora(load_causal_lm(cfg.base_model), cfg)   # only the adapter requires grad
    tensors = adapter_state_dict(model, ctx)                       # what the weight stream carries
    config = adapter_config_json(model)                            # its adapter_config.json, as a dict
    with model.disable_adapter(): ...                              # the base model: reference logprobs

The adapter follows Hu et al. 2021 (LoRA): W x + (alpha / r) B A x with A [r, in], B [out, r], B = 0 at start,
so version 0 of a LoRA run is the base model. A new adapter's A is PEFT's default init (kaiming-uniform with
a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) drawn from a generator seeded by the run's seed and the parameter's name
(`initial_adapter`), so a rank that builds the model on meta and fills only its own rows (the sharded loader,
fleetrl.trainer.sharded_load) gets exactly the adapter a whole load gets. Tensor names and the config are exactly
what PEFT's `save_pretrained` writes (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so a published
version, the promoted `final/` and an adapter from elsewhere are interchangeable.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from fleetrl.trainer.distributed import DistContext

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def all_linear_names(model: torch.nn.Module) -> list[str]:
    """The names (last part) of every linear layer in the decoder: all but the output head.

    PEFT's own "all-linear" resolves to full module paths (model.layers.0.mlp.down_proj, ...); short names select
    the same layers and give the adapter_config.json every loader (vLLM, PEFT) understands.
    """
    head = model.get_output_embeddings()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    if not names:
        raise ValueError("lora_target_modules = 'all-linear': the model has no linear layer besides its head")
    return sorted(names)


def lora_config(cfg: Any, model: torch.nn.Module | None = None) -> Any:
    """The `peft.LoraConfig` of the run config's lora_* fields ("all-linear" resolved on `model` when given)."""
    from peft import LoraConfig, TaskType

    alpha = cfg.lora_scale_alpha
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=cfg.lora_rank,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=(
            all_linear_names(model)
            if cfg.lora_target_modules == "all-linear" and model is not None
            else cfg.lora_target_modules
        ),
        bias="none",
    )


def wrap_with_lora(model: torch.nn.Module, cfg: Any) -> torch.nn.Module:
    """The PEFT model around `model`: a new adapter (B = 0, A seeded by `cfg.seed`: `initial_adapter`), or
    `cfg.warm_start_from_adapter`'s.

    Everything but the adapter is frozen. The adapter's parameters stay float32 when the base is bfloat16
    (PEFT's autocast_adapter_dtype), so AdamW updates full-precision master weights. A model on the meta device
    (the sharded loader's) gets the adapter's structure only: `adapter_start_tensors` gives its values.
    """
    try:
        from peft import LoraConfig, PeftModel, get_peft_model
    except ImportError as exc:
        raise ValueError(f"lora_rank = {cfg.lora_rank} needs PEFT: pip install 'fleetrl[lora]' ({exc})") from exc

    from fleetrl.config import check_warm_start_adapter

    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if check_warm_start_adapter(cfg) is not None:
        if on_meta:
            config = LoraConfig.from_pretrained(cfg.warm_start_from_adapter)
            config.inference_mode = False
            peft_model = get_peft_model(model, config)
        else:
            peft_model = PeftModel.from_pretrained(model, cfg.warm_start_from_adapter, is_trainable=True)
        logger.info("LoRA: warm start from the adapter at %s", cfg.warm_start_from_adapter)
    else:
        peft_model = get_peft_model(model, lora_config(cfg, model))
        if not on_meta:
            with torch.no_grad():
                base = peft_model.get_base_model()
                for name, value in initial_adapter(peft_model, cfg.seed).items():
                    base.get_parameter(name).copy_(value)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info(
        "LoRA rank %d: %d trainable parameters of %d (%.3f%%)",
        cfg.lora_rank,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return peft_model


def initial_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A new adapter's full tensors (float32, CPU), named as the wrapped base model's parameters: every lora_A
    U(-1/sqrt(in), 1/sqrt(in)) (PEFT's default: kaiming-uniform with a = sqrt(5)) from a generator seeded by `seed`
    and the name, every lora_B zeros. The same on every rank and whatever device the parameters are on."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out: dict[str, torch.Tensor] = {}
    for name, param in base.named_parameters():
        if not param.requires_grad:
            continue
        if ".lora_A." in name:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
            bound = 1.0 / math.sqrt(param.shape[1])
            out[name] = (torch.rand(tuple(param.shape), generator=gen) * 2 - 1) * bound
        elif ".lora_B." in name:
            out[name] = torch.zeros(tuple(param.shape))
        else:
            raise ValueError(f"LoRA: no initial value for the trainable parameter {name!r} (only lora_A / lora_B)")
    return out


def adapter_start_tensors(model: torch.nn.Module, cfg: Any) -> dict[str, torch.Tensor]:
    """The adapter's values at the start of a run, named as the wrapped base model's parameters: the warm-start
    adapter's file (`cfg.warm_start_from_adapter`) or a new adapter (`initial_adapter`)."""
    if cfg.warm_start_from_adapter is None:
        return initial_adapter(model, cfg.seed)
    from safetensors.torch import load_file

    stored = load_file(str(Path(cfg.warm_start_from_adapter) / ADAPTER_WEIGHTS))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out: dict[str, torch.Tensor] = {}
    for name, param in base.named_parameters():
        if not param.requires_grad:
            continue
        # PEFT saves "base_model.model.<name without the adapter name>".
        key = "base_model.model." + name.replace(f".{ADAPTER_NAME}.", ".")
        if key not in stored:
            raise ValueError(f"warm_start_from_adapter: {ADAPTER_WEIGHTS} has no tensor {key!r}")
        out[name] = stored[key]
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def adapter_config_json(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's config as the JSON object of its adapter_config.json (sets sorted, enums as values)."""
    config = model.peft_config[ADAPTER_NAME].to_dict()
    # PEFT writes inference_mode = true into a saved adapter; a loader of a published version wants the same.
    config["inference_mode"] = True
    out = _json_safe(config)
    json.dumps(out)  # proves it is JSON
    return out


def adapter_state_dict(
    model: torch.nn.Module, ctx: DistContext, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The full adapter tensors, named as PEFT saves them, on CPU on rank 0 (an empty dict on other ranks).

    Every rank must call it: under FSDP2 each adapter parameter is all-gathered on its own, so the frozen base is
    never gathered. `dtype` casts each tensor (the trainer's dtype for publishing; None keeps the parameter's).
    """
    from peft import get_peft_model_state_dict

    gathered: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # a DTensor shard under FSDP2: a collective on every rank
            tensor = tensor.full_tensor()
        if ctx.is_main:
            tensor = tensor.to("cpu", dtype=dtype or tensor.dtype).contiguous()
            gathered[name] = tensor if tensor.data_ptr() != param.data_ptr() else tensor.clone()
    if not ctx.is_main:
        return {}
    return get_peft_model_state_dict(model, state_dict=gathered, save_embedding_layers=False)


def save_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write a PEFT adapter folder (what `PeftModel.save_pretrained` writes: config and safetensors)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def merge_adapter(
    adapter_dir: str | Path, out: str | Path, *, base_model: str | None = None, dtype: str = "float32"
) -> Path:
    """Write base + adapter merged (W + alpha/r B A) as a plain HF model folder at `out`.

    `base_model`: the base to merge into; None = the adapter config's base_model_name_or_path. The tokenizer is
    copied from the adapter folder when it has one, else from the base.
    """
    from peft import PeftModel
    from transformers import AutoTokenizer

    from fleetrl.trainer.model import load_causal_lm

    adapter_dir, out = Path(adapter_dir), Path(out)
    if base_model is None:
        base_model = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    base = load_causal_lm(base_model, dtype=dtype, trainable=False)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    for source in (adapter_dir, base_model):
        try:
            AutoTokenizer.from_pretrained(str(source)).save_pretrained(out)
            break
        except (OSError, ValueError):
            continue
    return out
