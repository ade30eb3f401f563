"""Each engine's init info (fleetrl.weights.engine_init) is vLLM's own: the trainer side is the init-info class
vLLM's trainer factory dispatches on, with the rendezvous, world size and rank offsets of the plan, and each
replica's init dict parses into vLLM's worker-side init-info class (what the replica's engine does with
``engine_init_json``). All of vLLM's init-info classes construct on CPU, so no field is only assumed here."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCWeightTransferEngine
from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferEngine
from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource
from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLWeightTransferEngine

from fleetrl.weights.engine_init import EngineGroupPlan, trainer_init_info, worker_init_dicts
from fleetrl.weights.vllm_gloo import FanoutClient, GlooTrainerInitInfo, GlooWeightTransferEngine

# Two replicas as EngineSync counts them: r0 with 2 TP workers at rank 1, r1 with 2 at rank 3; world 5.
OFFSETS = {"r0": 1, "r1": 3}
WORKERS = {"r0": 2, "r1": 2}


def plan(engine: str, **kw) -> EngineGroupPlan:
    return EngineGroupPlan(engine, "10.0.0.1", 29555, OFFSETS, 5, replica_workers=WORKERS, bucket_bytes=1 << 20, **kw)


def test_nccl_is_vllms_trainer_and_worker_init_info_with_the_plans_ranks():
    info = trainer_init_info(plan("nccl"))
    assert isinstance(info, NCCLTrainerInitInfo) and info.backend == "nccl" and info.is_sender
    assert (info.master_address, info.master_port, info.world_size) == ("10.0.0.1", 29555, 5)
    assert info.packed and info.packed_buffer_size_bytes == 1 << 20
    workers = worker_init_dicts(plan("nccl"))
    for name, offset in OFFSETS.items():
        parsed = NCCLWeightTransferEngine.init_info_cls(**workers[name])
        assert (parsed.master_address, parsed.master_port) == ("10.0.0.1", 29555)
        assert (parsed.rank_offset, parsed.world_size, parsed.packed) == (offset, 5, True)
        assert parsed.packed_buffer_size_bytes == 1 << 20


def test_nccl_m2n_puts_every_trainer_rank_first_and_the_replicas_tp_workers_after_them():
    m2n = EngineGroupPlan(
        "nccl_m2n", "10.0.0.1", 29555, {"r0": 1}, 3, replica_workers={"r0": 2}, num_trainer_ranks=4, trainer_rank=2
    )
    info = trainer_init_info(m2n)
    assert isinstance(info, M2NTrainerInitInfo) and info.backend == "nccl_m2n" and not info.is_sender
    assert (info.world_size, info.num_trainer_ranks, info.dst_mesh_dims, info.rank) == (6, 4, (1, 2), 2)
    workers = worker_init_dicts(m2n)
    assert workers["r0"]["rank_offset"] == 4
    # vLLM's trainer adds the parameters' layout from its DTensorModuleSource; with them the dict is the worker's.
    source = DTensorModuleSource(torch.nn.Linear(4, 2), num_trainer_ranks=4)
    metas = source.metadata()
    parameters = {
        "src_mesh_dims": list(source.mesh().dims),
        "names": [m.name for m in metas],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "src_placements": [None for _ in metas],
    }
    parsed = M2NWeightTransferEngine.init_info_cls(**workers["r0"], **parameters)
    assert (parsed.rank_offset, parsed.world_size, list(parsed.dst_mesh_dims)) == (4, 6, [1, 2])


def test_nccl_m2n_refuses_two_replicas_in_one_group():
    # vLLM's m2n worker takes rank_offset as the trainer ranks: a second replica at offset 6 would be refused there.
    with pytest.raises(ValueError, match="one replica per group"):
        trainer_init_info(plan("nccl_m2n", num_trainer_ranks=2))


def test_only_nccl_m2n_takes_several_trainer_ranks():
    with pytest.raises(ValueError, match="only nccl_m2n"):
        plan("nccl", num_trainer_ranks=2)


def test_ipc_has_no_rendezvous_and_its_init_dict_gets_no_rank_offset():
    info = trainer_init_info(plan("ipc"))
    assert isinstance(info, IPCTrainerInitInfo) and info.backend == "ipc" and info.packed
    workers = worker_init_dicts(plan("ipc"))
    assert IPCWeightTransferEngine.init_info_cls(**workers["r0"]).packed

    class Recording:
        def __init__(self) -> None:
            self.init: dict | None = None

        def init_weight_transfer_engine(self, init_info: dict) -> None:
            self.init = init_info

    clients = {"r0": Recording(), "r1": Recording()}
    FanoutClient(clients, OFFSETS, 5.0).init_weight_transfer_engine(workers["r0"])
    for client in clients.values():  # IPCWeightTransferInitInfo(**init) would refuse a rank_offset
        assert client.init == {"packed": True}
        IPCWeightTransferEngine.init_info_cls(**client.init)


def test_fleetrl_gloo_init_info_is_the_cpu_stand_ins():
    info = trainer_init_info(plan("fleetrl_gloo", group_name="g-3"))
    assert isinstance(info, GlooTrainerInitInfo) and info.backend == "fleetrl_gloo"
    assert (info.world_size, info.group_name, info.bucket_bytes) == (5, "g-3", 1 << 20)
    workers = worker_init_dicts(plan("fleetrl_gloo"), gloo_port=4242)
    parsed = GlooWeightTransferEngine.init_info_cls(**workers["r1"])
    assert (parsed.master_port, parsed.rank_offset, parsed.world_size) == (4242, 3, 5)


def test_the_weight_stream_is_no_engine_group():
    with pytest.raises(ValueError, match="fleetrl_zmq"):
        trainer_init_info(plan("fleetrl_zmq"))
    with pytest.raises(ValueError, match="fleetrl_zmq"):
        worker_init_dicts(plan("fleetrl_zmq"))
