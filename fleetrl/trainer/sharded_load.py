"""Loading an HF causal LM straight into FSDP2 shards: no rank ever holds the whole model.

Under world size > 1 (full fine-tuning) the trainer builds the model with its parameters on the meta device (no
memory; buffers such as rotary `inv_freq` are computed for real, as at any init), shards it with `fully_shard`,
allocates each rank's shards (`to_empty`) and then fills them from the checkpoint's safetensors files, reading
only the rows of each parameter this rank holds (`safe_open(...).get_slice(name)[start:stop]`, a memory-mapped
read of those bytes). A rank's peak memory is about its shards plus one parameter's slice, instead of the whole
model in the checkpoint's dtype plus the whole model in the trainer's (bench/sharded_load.py; docs/trainer.md,
"Sharded loading").

A LoRA run loads the same way: the PEFT wrapper goes around the model while it is still on meta (`wrap`), so the
adapter is sharded with its layers, and the adapter's starting values (`start_tensors`: a new adapter's seeded init
or a warm-start adapter's file, fleetrl.trainer.lora) fill their rows as the checkpoint's do; the base layers' names
under PEFT (`q_proj.base_layer.weight`) read the checkpoint's (`q_proj.weight`).

Handles: single-file and sharded checkpoints (`model.safetensors.index.json`), uneven chunks (a parameter whose
first dimension does not divide by the ranks: the last ranks get fewer rows or none, as `torch.chunk`), tied
embeddings (the lm head absent from the file, read through the embedding it shares), HSDP meshes (replicated
across one mesh dimension, sharded across the other), and casting to the trainer's dtype.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fleetrl.model_path import adapter_instead_of_model, check_model_path
from fleetrl.trainer.model import ModelOptions, apply_model_options, torch_dtype

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep real buffers.

    Every parameter is moved to meta as it is registered, before the module's own init runs on it, so its random
    init costs nothing and its CPU allocation is never touched (never resident). Buffers (rotary `inv_freq`,
    computed from the config at init and in no checkpoint) stay as computed. `torch.device("meta")` would put
    those on meta too, and `to_empty` would leave them garbage."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # one already on meta may be tied: keep it
            held = module._parameters[name]
            assert held is not None
            extra = held.__dict__  # e.g. HF's _is_hf_initialized
            module._parameters[name] = type(held)(held.to("meta"), requires_grad=held.requires_grad)
            module._parameters[name].__dict__.update(extra)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """The safetensors file holding each tensor of the model folder `path` (the index of a sharded checkpoint, or
    every tensor of the one file)."""
    from safetensors import safe_open

    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise ValueError(
            f"base_model: {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; sharded loading reads safetensors "
            "(save the model with save_pretrained(safe_serialization=True))"
        )
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def chunk_range(length: int, chunks: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk `index` when `length` rows are split into `chunks` as `torch.chunk` (and DTensor's
    `Shard`) split them: ceil(length / chunks) rows each, the last ones shorter or empty."""
    size = -(-length // chunks)
    start = min(index * size, length)
    return start, min(start + size, length)


def local_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dimension 0 this rank holds of a DTensor sharded on dimension 0 (FSDP2's
    `Shard(0)`, on any mesh dimension, replicated on the others); None for a plain tensor (all rows)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    start, stop = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise ValueError(f"sharded loading reads dimension-0 shards only, not {placement}")
        lo, hi = chunk_range(stop - start, mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim))
        start, stop = start + lo, start + hi
    return start, stop


def _tied_sources(model: torch.nn.Module) -> dict[str, list[str]]:
    """Every name each (deduplicated) parameter goes by: a tied lm head is the embedding under a second name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {aliases[0]: aliases for aliases in names.values()}


def _stored_names(name: str) -> list[str]:
    """The checkpoint names a parameter may be stored under: its own, and without PEFT's `base_layer.` level."""
    plain = name.replace(".base_layer.", ".")
    return [name] if plain == name else [name, plain]


@torch.no_grad()
def _fill_from(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy this rank's rows of the full tensor `value` into `param` (a DTensor shard or a plain tensor)."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: the starting value is {list(value.shape)}, the model has {list(param.shape)}")
    local = param.to_local() if hasattr(param, "to_local") else param
    rows = local_rows(param)
    local.copy_(value if rows is None else value[rows[0] : rows[1]])


@torch.no_grad()
def load_shards(model: torch.nn.Module, path: str | Path, start_tensors: dict[str, torch.Tensor] | None = None) -> int:
    """Fill every parameter of the sharded, materialised `model` with its rows from the safetensors files of `path`,
    cast to the parameter's dtype; returns the bytes read. A parameter the files lack (under none of its tied
    names) fails, naming it. `start_tensors` (full tensors by parameter name, e.g. a LoRA adapter's starting values)
    fill the parameters they name instead of the files. A PEFT model is filled through the model it wraps.

    Each slice is read through its own `safe_open`: the slice is a view of the memory-mapped file, and its pages
    count in the rank's resident memory for as long as the file stays open, so one open file for the lot would
    end up holding this rank's share of the checkpoint twice (the file pages and the parameters). `copy_` casts
    into the shard without a temporary in the new dtype."""
    from safetensors import safe_open

    files = checkpoint_files(path)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    start_tensors = start_tensors or {}
    aliases = _tied_sources(model)
    read = 0
    for name, param in model.named_parameters():
        if name in start_tensors:
            _fill_from(param, start_tensors[name], name)
            continue
        candidates = [stored for alias in aliases.get(name, [name]) for stored in _stored_names(alias)]
        stored = next((alias for alias in candidates if alias in files), None)
        if stored is None:
            raise ValueError(f"base_model: {path} has no tensor {name!r} (nor any name it is tied to)")
        local = param.to_local() if hasattr(param, "to_local") else param
        rows = local_rows(param)
        with safe_open(str(files[stored]), framework="pt") as f:
            tensor_slice = f.get_slice(stored)
            global_shape = tuple(tensor_slice.get_shape())
            if global_shape != tuple(param.shape):
                raise ValueError(
                    f"base_model: {stored} is {list(global_shape)} in {files[stored]}, the model has "
                    f"{list(param.shape)}"
                )
            values = tensor_slice[:] if rows is None else tensor_slice[rows[0] : rows[1]]
            if values.shape != local.shape:
                raise ValueError(
                    f"{name}: rows {rows} of {list(global_shape)} do not fill the local shard {list(local.shape)}"
                )
            local.copy_(values)
            read += values.numel() * values.element_size()
            del values
    # Persistent buffers the checkpoint holds (not sharded: each rank reads them whole); the others keep their init.
    for name, buffer in model.named_buffers():
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                buffer.copy_(f.get_tensor(name))
    return read


def load_sharded_causal_lm(
    path: str,
    shard: Callable[[torch.nn.Module], Any],
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    device: str | torch.device = "cpu",
    options: ModelOptions | None = None,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    start_tensors: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None,
) -> torch.nn.Module:
    """The HF causal LM at the local folder `path`, built on meta, sharded by `shard` (e.g. `fdist.shard_model` with
    the trainer's mesh and precision), materialised on `device` and filled rank by rank from its safetensors files.

    What `load_causal_lm` gives, sharded: parameters in `dtype`, train mode, `use_cache` off, `options` applied
    before sharding (`gradient_checkpointing` adds whole-layer checkpointing when they set none). `wrap` (e.g.
    fleetrl.trainer.lora.wrap_with_lora) wraps the model on meta before it is sharded, and `start_tensors(model)`
    gives the full starting values of the parameters the checkpoint does not hold (the adapter's). Every rank must
    call it (the mesh is collective)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not path:
        raise ValueError("base_model is empty: give the path of an HF causal LM")
    adapter = adapter_instead_of_model(path)
    if adapter is not None:
        raise ValueError(f"base_model: {adapter}")
    check_model_path(path)
    if not Path(path).is_dir():  # a hub id: its files, from the local cache when there
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    torch_type = torch_dtype(dtype)
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_type)
    model.config.use_cache = False
    model.train()
    if wrap is not None:
        model = wrap(model)
    starting = start_tensors(model) if start_tensors is not None else None
    apply_model_options(model, (options or ModelOptions()).with_checkpointing(bool(gradient_checkpointing)))
    # to_empty replaces buffers too: keep the ones computed at init (rotary inv_freq) and put them back.
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    shard(model)
    model.to_empty(device=device)
    for name, value in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        getattr(owner, buffer_name).copy_(value.to(device))
    read = load_shards(model, path, starting)
    logger.info("loaded %s sharded: %.1f MB read by this rank", path, read / 1e6)
    return model
