"""LoRA adapter versions on the inference side: check one against the served model (pure logic, no grpc/zmq).

A LoRA run publishes each version as the PEFT adapter only (`Manifest.adapter` is the JSON of
`adapter_config.json`; the tensors are `get_peft_model_state_dict`'s, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). Both engines check a version with
`plan_adapter` before anything is loaded, so a bad adapter (unknown target module, wrong shape, rank above
`--max-lora-rank`, a PEFT feature no engine applies) is refused with a `WeightLoadError` naming the problem
and the previous version keeps serving. The plan lists, per adapted linear layer, the base weight it adds
`scaling * B @ A` to (LoRA, Hu et al. 2021, eq. 3; scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetrl.services.inference.engine import WeightLoadError

# name -> (shape, dtype name), the form of both the model's spec and a manifest's entries.
Spec = Mapping[str, tuple[tuple[int, ...], str]]

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
# PEFT options that change what an adapter computes and that neither engine applies.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "layer_replication": "layer_replication",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
}


@dataclass(frozen=True)
class AdaptedLayer:
    """One linear layer the adapter changes: weight += scaling * B @ A."""

    weight: str  # the base weight's name in the model's state dict ("model.layers.0.self_attn.q_proj.weight")
    lora_a: str  # the adapter tensor names, as the manifest has them
    lora_b: str


@dataclass(frozen=True)
class AdapterPlan:
    """A checked adapter: its rank, scaling and the layers it adapts (in manifest order)."""

    rank: int
    scaling: float
    layers: tuple[AdaptedLayer, ...]


def lora_scaling(config: Mapping[str, Any]) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def plan_adapter(config: Mapping[str, Any] | None, tensors: Spec, model: Spec, max_rank: int) -> AdapterPlan:
    """Check an adapter version against the served model's weights (`model`: its state dict spec).

    `config` is the manifest's adapter config (None: the version is a full model, refused here);
    `tensors` the manifest's entries; `max_rank` the engine's `--max-lora-rank` (0 = LoRA off).
    Raises WeightLoadError naming every problem found.
    """
    if config is None:
        raise WeightLoadError("the version is a full model, not a LoRA adapter")
    if max_rank <= 0:
        raise WeightLoadError(
            "the version is a LoRA adapter but this replica serves full weights only; start it with "
            "--max-lora-rank R (R >= the adapter's rank) to serve adapters"
        )
    _check_config(config, max_rank)
    problems: list[str] = []
    linear = {name.removesuffix(".weight"): shape for name, (shape, _) in model.items() if len(shape) == 2}
    problems += _check_targets(config.get("target_modules"), linear)
    rank = int(config["r"])
    pairs: dict[str, dict[str, str]] = {}
    for name, (shape, dtype) in tensors.items():
        match = _PEFT_KEY.match(name)
        if match is None:
            problems.append(f"{name}: not a LoRA tensor (expected base_model.model.<module>.lora_A/B.weight)")
            continue
        module, ab = match["module"], match["ab"]
        if module not in linear:
            problems.append(f"{name}: the model has no linear layer {module!r}")
            continue
        if dtype not in _FLOAT_DTYPES:
            problems.append(f"{name}: dtype {dtype} is not a floating type")
        out_features, in_features = linear[module]
        expected = (rank, in_features) if ab == "A" else (out_features, rank)
        if tuple(shape) != expected:
            layer = f"r={rank}, layer {out_features}x{in_features}"
            problems.append(f"{name}: shape {list(shape)} != {list(expected)} ({layer})")
        pairs.setdefault(module, {})[ab] = name
    for module, names in pairs.items():
        if len(names) != 2:
            problems.append(f"{module}: lora_{'A' if 'A' not in names else 'B'} is missing")
    if not pairs and not problems:
        problems.append("the adapter has no LoRA tensors")
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise WeightLoadError("LoRA adapter does not fit the model: " + "; ".join(problems[:8]) + more)
    layers = tuple(AdaptedLayer(f"{m}.weight", n["A"], n["B"]) for m, n in pairs.items())
    return AdapterPlan(rank=rank, scaling=lora_scaling(config), layers=layers)


def _check_config(config: Mapping[str, Any], max_rank: int) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise WeightLoadError(f"adapter peft_type {peft_type!r} is not supported (LoRA only)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise WeightLoadError(f"adapter config: r must be a positive int, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise WeightLoadError(f"adapter config: lora_alpha must be a positive number, got {alpha!r}")
    if r > max_rank:
        raise WeightLoadError(f"adapter rank r={r} exceeds this replica's --max-lora-rank {max_rank}")
    used = [what for key, what in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r}")
    if used:
        raise WeightLoadError(f"adapter uses {', '.join(used)}, which the inference engines do not apply")


def _check_targets(targets: Any, linear: Mapping[str, Any]) -> list[str]:
    """Each named target module must be a linear layer of the model (PEFT's suffix match)."""
    if targets is None or targets == "all-linear":
        return []
    if isinstance(targets, str):  # a regex over full module names, as PEFT reads a string
        if not any(re.fullmatch(targets, module) for module in linear):
            return [f"target_modules {targets!r} matches no linear layer of the model"]
        return []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        return [f"target_modules must be a list of names or a string, got {targets!r}"]
    unknown = [t for t in targets if not any(m == t or m.endswith(f".{t}") for m in linear)]
    if unknown:
        known = sorted({m.rsplit(".", 1)[-1] for m in linear})
        return [f"unknown target modules {unknown} (the model's linear layers: {known})"]
    return []
