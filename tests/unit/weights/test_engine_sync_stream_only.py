"""A replica whose engine cannot join a weight-transfer group (an hf replica started by hand into a run with
weight_transport = "engine") is in the fleet but never in the group (fleetrl.weights.engine_sync,
`ReplicaInfo.engine_group`): it loads every version over the weight stream, the vLLM replicas keep their one group,
and its stream loads are no fallback. Before, every build named it, failed on it, and sent every replica over the
stream at every push. Pure: the scripted transport of test_engine_sync."""

from __future__ import annotations

from fleetrl.weights.engine_sync import EngineSync, ReplicaInfo
from tests.unit.weights.test_engine_sync import ScriptedTransport


class GroupRefusingTransport(ScriptedTransport):
    """A build naming the hf replica fails, as its UNIMPLEMENTED JoinEngineGroup would make it."""

    def build(self, replicas, rank_offsets, world_size):
        super().build(replicas, rank_offsets, world_size)
        if any(r.name == "hf" for r in replicas):
            raise RuntimeError("JoinEngineGroup: UNIMPLEMENTED")


def test_an_hf_replica_loads_over_the_stream_beside_one_group_of_the_vllm_replicas():
    transport = GroupRefusingTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("vllm-0"))
    sync.join(ReplicaInfo("hf", engine_group=False))
    sync.join(ReplicaInfo("vllm-1", workers=2))
    for version in (1, 2, 3):
        outcome = sync.push(version)
        assert (outcome.engine, outcome.stream, outcome.failed, outcome.error) == (["vllm-0", "vllm-1"], ["hf"], [], "")
    builds = [call for call in transport.calls if call[0] == "build"]
    assert builds == [("build", ("vllm-0", "vllm-1"), {"vllm-0": 1, "vllm-1": 2}, 4)]  # once, without it
    assert sync.builds == 1 and sync.fallbacks == 0 and sync.served_version == 3


def test_a_fleet_left_with_hf_replicas_only_drops_the_group_and_streams():
    transport = ScriptedTransport()
    sync = EngineSync(transport)
    sync.join(ReplicaInfo("vllm-0"))
    sync.join(ReplicaInfo("hf", engine_group=False))
    sync.push(1)
    sync.leave("vllm-0")
    outcome = sync.push(2)
    assert (outcome.engine, outcome.stream) == ([], ["hf"]) and sync.group is None
    assert transport.calls[-2:] == [("teardown",), ("stream", "hf", 2)]
