"""Which engine the trainer's EnginePusher (fleetrl.weights.engine_push) drives: fleetrl_gloo with trainer and
replicas on CPU, vLLM's nccl with both on CUDA (each tensor copied to the trainer's GPU as it is sent), through one
`EngineGroupTransport`; a layout with no collective between its ends is refused naming the engine. Constructing the
pusher opens no connection and needs no GPU (the group is built at the first push)."""

from __future__ import annotations

import pytest
import torch

from fleetrl.weights.engine_push import EnginePusher
from fleetrl.weights.engine_transport import OnDevice
from fleetrl.weights.gather import ShardedWeights


def pusher(**kw) -> EnginePusher:
    return EnginePusher(lambda version: {}, "tcp://127.0.0.1:1", **kw)


@pytest.mark.parametrize(
    ("device", "engine", "source"), [("cpu", "fleetrl_gloo", ShardedWeights), ("cuda", "nccl", OnDevice)]
)
def test_the_pusher_drives_the_engine_of_its_layout(device, engine, source):
    engine_pusher = pusher(trainer_device=device)
    try:
        assert engine_pusher.engine_name == engine and engine_pusher.transport.engine_name == engine
        assert isinstance(engine_pusher._source({"w": torch.ones(2)}), source)
    finally:
        engine_pusher.close()


def test_a_gpu_trainer_with_cpu_replicas_is_refused_naming_the_engine():
    with pytest.raises(ValueError, match="'fleetrl_zmq' engine is not driven"):
        pusher(trainer_device="cuda", replica_device="cpu")
