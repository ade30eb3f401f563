"""Data-parallel training across processes: FSDP2 sharding, full-weight gathering, rank-0 broadcasts.

Under `torchrun --nproc-per-node N` (world size > 1), on one machine or across machines (`--nnodes M
--rdzv-backend c10d`), every rank loads the model and shards it with FSDP2 (`fully_shard` per decoder
layer, then the root). Sharding "fsdp" shards over every rank (a 1-D mesh); "hsdp" shards within a node
and replicates across nodes (a 2-D mesh `(replicate = nodes, shard = ranks per node)`: parameters are
all-gathered over the fast intra-node links only, gradients reduce-scattered within the node and then
all-reduced across nodes). Rank 0 owns the sockets: it receives groups,
talks to the reference service and publishes weights; it broadcasts each command to the other ranks
(JSON bytes: a step's header with the figures every rank needs), then sends each rank only the rows it
trains (`scatter_tensors`: one point-to-point message of plain tensors per rank), so nothing is pickled
and no rank receives the whole batch. `RECEIVED` counts the bytes a rank has received from rank 0.
With world size 1 everything here is a no-op and no process group is created.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

Sharding = Literal["fsdp", "hsdp"]
SHARDINGS: tuple[str, ...] = ("fsdp", "hsdp")


@dataclass
class DistContext:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    comm_device: str = "cpu"  # where broadcast buffers live: cuda for nccl, cpu for gloo
    local_world_size: int = 0  # ranks on this node (torchrun's LOCAL_WORLD_SIZE); 0 = all of them
    sharding: Sharding = "fsdp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh FSDP2 shards over: `(world,)` for fsdp, `(nodes, ranks per node)` for hsdp."""
        return mesh_shape(self.sharding, self.world_size, self.local_world_size or self.world_size)

    @classmethod
    def from_env(cls, *, device: str = "cpu", timeout_s: float = 3600.0, sharding: Sharding = "fsdp") -> DistContext:
        """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE; init the process group when world > 1.

        Backend: nccl for cuda, gloo for cpu. `timeout_s` bounds every collective, including the
        followers' wait for rank 0's next command. `sharding` picks the FSDP2 mesh (see `mesh_shape`);
        a layout hsdp does not fit fails here, on every rank, before the model loads.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        cuda = device.startswith("cuda")
        comm = f"cuda:{local_rank}" if cuda else "cpu"
        ctx = cls(int(os.environ.get("RANK", "0")), world, local_rank, comm, local_world, sharding)
        shape = ctx.mesh_shape  # raises for a layout the sharding does not fit
        if ctx.enabled and not dist.is_initialized():
            backend = "nccl" if cuda else "gloo"
            kwargs: dict[str, Any] = {}
            if cuda:
                # Bind this rank's GPU before anything touches CUDA: otherwise the first CUDA call (NCCL's, the
                # mesh's, the model's move) lands on cuda:0, `init_device_mesh` then skips its own set_device,
                # and `fully_shard` puts every rank's parameters on cuda:0. `device_id` binds NCCL's
                # communicator to the same GPU eagerly.
                torch.cuda.set_device(local_rank)
                kwargs["device_id"] = torch.device("cuda", local_rank)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
            logger.info(
                "rank %d/%d: process group up (%s); %s mesh %s", ctx.rank, world, backend, sharding, list(shape)
            )
        return ctx

    def device(self, device: str) -> torch.device:
        if device.startswith("cuda") and self.enabled:
            return torch.device("cuda", self.local_rank)
        return torch.device(device)


def mesh_shape(sharding: str, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """FSDP2's device mesh: `(world,)` for fsdp; `(nodes, ranks per node)` for hsdp (replicate across nodes,
    shard within one). torchrun numbers the ranks of a node contiguously, so a mesh row is one node."""
    if sharding == "fsdp":
        return (world_size,)
    if sharding != "hsdp":
        raise ValueError(f"sharding: {sharding!r} is not one of {', '.join(SHARDINGS)}")
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"sharding = hsdp: {world_size} ranks do not split into nodes of {local_world_size} ranks "
            "(every node must run the same number of ranks)"
        )
    return (world_size // local_world_size, local_world_size)


def shard_model(
    model: torch.nn.Module,
    device: torch.device,
    world_size: int,
    shape: tuple[int, ...] | None = None,
    compute_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, final norm, lm head), over a mesh of `shape`
    (default `(world_size,)`; a 2-D `(replicate, shard)` shape is HSDP, see `mesh_shape`).

    `compute_dtype` (e.g. bfloat16 for float32 parameters) is mixed precision: FSDP2's `MixedPrecisionPolicy`
    all-gathers the parameters in that dtype for forward and backward while the sharded parameters, their
    gradients and the optimizer state stay in the parameters' dtype, and gradients are reduce-scattered in
    float32 (an lr-1e-6 update survives; in bfloat16 it would round away). `cpu_offload`: FSDP2's `CPUOffloadPolicy`:
    the sharded parameters, their gradients and the optimizer step in host memory (pinned on CUDA), each layer copied
    to the device for its forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    shape = shape or (world_size,)
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (model.model.layers for Llama/Qwen-style); a PEFT
    model's are those of the model it wraps."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        logger.warning("no decoder layer list found; sharding the whole model as one unit")
        return []
    return list(layers)


def full_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, on CPU; an empty dict on the other ranks.

    Every rank must call it (it all-gathers the shards). With world size 1 it is the model's own
    state dict (live tensors: consumers that keep them must copy, as the weight publisher does).
    """
    if not ctx.enabled:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


EXPORT_FILE_BYTES = 5 << 30  # HF's own shard size for save_pretrained


def export_sharded_hf(model: torch.nn.Module, out: Path, dtype: torch.dtype, ctx: DistContext) -> None:
    """Write the model's weights in HF safetensors format from every rank's own shards (torch.distributed.checkpoint's
    HuggingFaceStorageWriter): each rank writes its shards cast to `dtype`, then rank 0 consolidates them file by file
    into `out` (5 GiB files and an index, or one model.safetensors), reading from disk: no rank gathers the model in
    memory. Every rank must call it; config and tokenizer are the caller's."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {name: tensor.detach().to(dtype) for name, tensor in get_model_state_dict(model).items()}
    itemsize = torch.empty((), dtype=dtype).element_size()
    mapping, index, filled = {}, 1, 0
    for name, tensor in state.items():
        size = tensor.numel() * itemsize
        if filled and filled + size > EXPORT_FILE_BYTES:
            index, filled = index + 1, 0
        mapping[name], filled = index, filled + size
    writer = dcp.HuggingFaceStorageWriter(
        str(out), fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    if ctx.is_main:
        shutil.rmtree(out / "sharded", ignore_errors=True)
        if index == 1:  # one file: named as save_pretrained names it
            (out / "model-00001-of-00001.safetensors").rename(out / "model.safetensors")
            (out / "model.safetensors.index.json").unlink(missing_ok=True)
    barrier(ctx)


@dataclass
class ReceivedBytes:
    """Bytes this process has received from rank 0, by kind: "broadcast" (commands, headers, broadcast tensors)
    and "scatter" (its own share of a step's rows). Rank 0 receives nothing and counts nothing."""

    broadcast: int = 0
    scatter: int = 0

    def reset(self) -> None:
        self.broadcast = self.scatter = 0


RECEIVED = ReceivedBytes()


def broadcast_json(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's JSON-able `obj` on every rank (others pass anything, e.g. None)."""
    if not ctx.enabled:
        return obj
    if ctx.is_main:
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.long, device=ctx.comm_device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=ctx.comm_device)
    dist.broadcast(size, src=0)
    if ctx.is_main:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(ctx.comm_device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=ctx.comm_device)
    dist.broadcast(buf, src=0)
    if not ctx.is_main:
        RECEIVED.broadcast += _nbytes(size) + _nbytes(buf)
    return obj if ctx.is_main else json.loads(bytes(buf.cpu().numpy()).decode())


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | None, specs: dict[str, tuple[torch.dtype, int]], ctx: DistContext
) -> dict[str, torch.Tensor]:
    """Broadcast 1-D CPU tensors from rank 0; `specs` gives every rank their dtype and length."""
    if not ctx.enabled:
        assert tensors is not None
        return tensors
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, length) in specs.items():
        if ctx.is_main:
            assert tensors is not None
            t = tensors[name].contiguous().to(ctx.comm_device)
        else:
            t = torch.empty(length, dtype=dtype, device=ctx.comm_device)
        dist.broadcast(t, src=0)
        if not ctx.is_main:
            RECEIVED.broadcast += _nbytes(t)
        out[name] = t.cpu()
    return out


def scatter_tensors(
    parts: Sequence[dict[str, torch.Tensor]] | None, specs: dict[str, tuple[torch.dtype, int]], ctx: DistContext
) -> dict[str, torch.Tensor]:
    """Rank r gets `parts[r]` (1-D CPU tensors, rank 0 passes one dict per rank) and no other rank's; `specs` gives
    every rank the dtype and length of each of its own tensors. Rank 0 sends each other rank its tensors packed
    into one byte buffer (a point-to-point send, which gloo and nccl both support, in any size: `dist.scatter`
    needs equal sizes); a rank with nothing to receive gets no message."""
    if ctx.is_main or not ctx.enabled:
        assert parts is not None and len(parts) == ctx.world_size
    if not ctx.enabled:
        return parts[0]  # type: ignore[index]
    if ctx.is_main:
        assert parts is not None
        sends = []
        for rank in range(1, ctx.world_size):
            buf = _pack(parts[rank]).to(ctx.comm_device)
            if buf.numel():
                sends.append((dist.isend(buf, dst=rank), buf))  # the buffer lives until its send is done
        for work, _ in sends:
            work.wait()
        return parts[0]
    names = sorted(specs)
    sizes = [specs[n][1] * _itemsize(specs[n][0]) for n in names]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=ctx.comm_device)
    if buf.numel():
        dist.recv(buf, src=0)
        RECEIVED.scatter += _nbytes(buf)
    chunks = buf.cpu().split(sizes)
    return {n: c.clone().view(specs[n][0]) for n, c in zip(names, chunks, strict=True)}


def _pack(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes end to end, in name order (as `scatter_tensors` unpacks them)."""
    views = [tensors[n].detach().cpu().contiguous().view(-1).view(torch.uint8) for n in sorted(tensors)]
    return torch.cat(views) if views else torch.empty(0, dtype=torch.uint8)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of a list of floats over all ranks (float64)."""
    if not ctx.enabled or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def destroy(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
