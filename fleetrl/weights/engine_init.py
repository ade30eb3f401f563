"""Each weight-transfer engine's init info, built from one engine group's plan: vLLM's own trainer-side init info
(what ``WeightTransferTrainerFactory.trainer_init`` takes) and each replica's worker-side init dict (what the
trainer's engine sends it through ``init_weight_transfer_engine``, i.e. JoinEngineGroup's ``engine_init_json``).

Pure (no socket, no process group, no CUDA): vLLM's init-info dataclasses are plain data and construct on CPU, so
this is tested for every engine there (tests/unit/weights/test_engine_init.py) although vLLM's "nccl", "nccl_m2n" and
"ipc" engines themselves only run on GPUs.

- "nccl" (`NCCLTrainerInitInfo`): the trainer is rank 0 of one communicator and opens its TCPStore rendezvous at
  ``master_address:master_port`` (a concrete port: the workers are told it before the trainer opens it); each replica's
  workers join at its rank offset (its TP worker ``t`` at offset + ``t``); packed double-buffered broadcast.
- "nccl_m2n" (`M2NTrainerInitInfo`): every trainer rank is in the communicator, at ranks ``[0, num_trainer_ranks)``,
  and sends its own shard (vLLM's `DTensorModuleSource` over the live module), so the replicas' offsets start after
  the trainer ranks. vLLM's m2n worker reads ``rank_offset`` as the number of trainer ranks and places its workers
  by vLLM's own data-parallel index, so one group holds one replica (its destination mesh ``(1, TP size)``);
  several fleetrl replicas would need one group each. vLLM adds the names, shapes and placements to the workers'
  init dict itself (from the source), after what is built here.
- "ipc" (`IPCTrainerInitInfo`): no rendezvous; the worker is told only the must-agree ``packed`` flag.
- "fleetrl_gloo" (`fleetrl.weights.vllm_gloo.GlooTrainerInitInfo`): the CPU stand-in for "nccl" (master port 0: its
  trainer opens the store on a free port and tells the workers the port it got).
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["COLLECTIVE_ENGINES", "EngineGroupPlan", "free_port", "trainer_init_info", "worker_init_dicts"]

COLLECTIVE_ENGINES = ("nccl", "nccl_m2n", "fleetrl_gloo")  # a communicator that a dead peer breaks
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's packed_tensor default
DEFAULT_PACKED_BUFFERS = 2


@dataclass(frozen=True)
class EngineGroupPlan:
    """One engine group: `rank_offsets` and `world_size` as `fleetrl.weights.engine_sync.EngineSync` counts them
    (one trainer rank, rank 0, then each replica's workers); `num_trainer_ranks` > 1 only for "nccl_m2n" (every
    trainer rank joins), which shifts the replicas after the trainer ranks."""

    engine: str
    master_address: str
    master_port: int
    rank_offsets: dict[str, int]
    world_size: int
    trainer_rank: int = 0
    num_trainer_ranks: int = 1
    replica_workers: dict[str, int] = field(default_factory=dict)  # each replica's TP size (nccl_m2n's mesh)
    group_name: str = "fleetrl-gloo"
    bucket_bytes: int = DEFAULT_PACKED_BUFFER_BYTES
    packed_buffers: int = DEFAULT_PACKED_BUFFERS
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.num_trainer_ranks < 1:
            raise ValueError(f"num_trainer_ranks must be >= 1, got {self.num_trainer_ranks}")
        if self.num_trainer_ranks > 1 and self.engine != "nccl_m2n":
            raise ValueError(
                f"num_trainer_ranks {self.num_trainer_ranks}: only nccl_m2n puts every trainer rank in the group "
                f"({self.engine!r}: rank 0 sends alone)"
            )

    def group_ranks(self) -> tuple[dict[str, int], int]:
        """The replicas' rank offsets and the world size in the communicator itself (after every trainer rank)."""
        shift = self.num_trainer_ranks - 1
        return {name: offset + shift for name, offset in self.rank_offsets.items()}, self.world_size + shift

    def destination_mesh(self) -> tuple[int, int]:
        """nccl_m2n's inference mesh: (1, the replica's TP size). ValueError for more than one replica: vLLM's m2n
        worker takes ``rank_offset`` as the number of trainer ranks and places its workers by vLLM's own
        data-parallel index, so separate fleetrl replicas (each data-parallel index 0) cannot share one group."""
        if len(self.rank_offsets) != 1:
            raise ValueError(
                f"nccl_m2n takes one replica per group (vLLM's m2n counts rank_offset as the trainer ranks), got "
                f"{len(self.rank_offsets)}: {sorted(self.rank_offsets)}"
            )
        (name,) = self.rank_offsets
        return 1, self.replica_workers.get(name, 1)


def free_port(host: str) -> int:
    """A port free on `host` now (vLLM's NCCL rendezvous needs one the workers can be told before it opens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def trainer_init_info(plan: EngineGroupPlan) -> Any:
    """vLLM's trainer-side init info for `plan.engine` (the factory dispatches on its ``backend``)."""
    if plan.engine == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(
            plan.master_address,
            plan.master_port,
            plan.world_size,
            packed=True,
            packed_buffer_size_bytes=plan.bucket_bytes,
            packed_num_buffers=plan.packed_buffers,
            rank=plan.trainer_rank,
        )
    if plan.engine == "nccl_m2n":
        from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

        _, world = plan.group_ranks()
        return M2NTrainerInitInfo(
            master_address=plan.master_address,
            master_port=plan.master_port,
            world_size=world,
            num_trainer_ranks=plan.num_trainer_ranks,
            dst_mesh_dims=plan.destination_mesh(),
            rank=plan.trainer_rank,
        )
    if plan.engine == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=plan.bucket_bytes, rank=plan.trainer_rank)
    if plan.engine == "fleetrl_gloo":
        from fleetrl.weights.vllm_gloo import GlooTrainerInitInfo

        return GlooTrainerInitInfo(
            plan.master_address,
            plan.master_port,
            plan.world_size,
            group_name=plan.group_name,
            bucket_bytes=plan.bucket_bytes,
            timeout_s=plan.timeout_s,
            rank=plan.trainer_rank,
        )
    raise ValueError(f"no engine group for weight-transfer engine {plan.engine!r} (the stream is no group)")


def worker_init_dicts(plan: EngineGroupPlan, gloo_port: int | None = None) -> dict[str, dict[str, Any]]:
    """Each replica's worker-side init dict, as its trainer engine sends it and `FanoutClient` gives each replica
    its own ``rank_offset``: vLLM's worker init-info fields (``engine_init_json``). `gloo_port`: the port the
    fleetrl_gloo trainer's store got. nccl_m2n: the rendezvous and meshes only (vLLM appends the parameters)."""
    offsets, world = plan.group_ranks()
    dicts: dict[str, dict[str, Any]] = {}
    for name, offset in offsets.items():
        if plan.engine == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

            info = NCCLWeightTransferInitInfo(
                master_address=plan.master_address,
                master_port=plan.master_port,
                rank_offset=offset,
                world_size=world,
                packed=True,
                packed_buffer_size_bytes=plan.bucket_bytes,
                packed_num_buffers=plan.packed_buffers,
            )
            dicts[name] = worker_init_payload(info)
        elif plan.engine == "nccl_m2n":
            dicts[name] = {
                "master_address": plan.master_address,
                "master_port": plan.master_port,
                "rank_offset": offset,
                "world_size": world,
                "dst_mesh_dims": list(plan.destination_mesh()),
            }
        elif plan.engine == "ipc":
            dicts[name] = {"packed": True}
        elif plan.engine == "fleetrl_gloo":
            from fleetrl.weights.vllm_gloo import GlooInitInfo

            port = plan.master_port if gloo_port is None else gloo_port
            dicts[name] = asdict(
                GlooInitInfo(
                    plan.master_address,
                    port,
                    rank_offset=offset,
                    world_size=world,
                    group_name=plan.group_name,
                    bucket_bytes=plan.bucket_bytes,
                    timeout_s=plan.timeout_s,
                )
            )
        else:
            raise ValueError(f"no engine group for weight-transfer engine {plan.engine!r} (the stream is no group)")
    return dicts
