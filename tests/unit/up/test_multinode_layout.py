"""The multi-node trainer layout of `fleetrl up`: [up] validation, the torchrun agents' argv, the FSDP2 mesh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.config import ConfigError
from fleetrl.trainer.distributed import DistContext, mesh_shape
from fleetrl.up.config import UpConfig
from fleetrl.up.run import start_trainer
from fleetrl.up.supervisor import Child, ServiceFailed, Supervisor, torchrun_argv


def write(tmp_path: Path, up: dict) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {"base_model": "m"}, "up": {"rollout": "m:f", **up}}))
    return path


@pytest.mark.parametrize(
    ("up", "message"),
    [
        ({"trainer_nodes": 0}, "up.trainer_nodes: Input should be greater than or equal to 1"),
        (
            {"trainer_nodes": 2, "trainer_procs": 2, "trainer_gpus": [0, 1]},
            "trainer_gpus has 2 GPUs but trainer_nodes x trainer_procs is 4",
        ),
        ({"trainer_nodes": 2, "trainer_sharding": "hsdp"}, "hsdp needs trainer_nodes > 1 and trainer_procs > 1"),
        ({"trainer_procs": 2, "trainer_sharding": "hsdp"}, "hsdp needs trainer_nodes > 1 and trainer_procs > 1"),
        ({"trainer_sharding": "ddp"}, "up.trainer_sharding: Input should be 'fsdp' or 'hsdp'"),
        ({"inference_tensor_parallel_size": 2}, "inference_tensor_parallel_size = 2 needs engine = 'vllm'"),
        (
            {"engine": "vllm", "inference_tensor_parallel_size": 2, "inference_gpus": [[0, 1], [2]], "replicas": 2},
            r"each replica needs inference_tensor_parallel_size = 2 GPUs, has \[2, 1\]",
        ),
    ],
)
def test_a_layout_that_cannot_run_fails_naming_the_field(tmp_path, up, message):
    with pytest.raises(ConfigError, match=message):
        UpConfig.from_file(write(tmp_path, up))


def test_each_trainer_node_gets_its_own_gpus(tmp_path):
    up = UpConfig.from_file(write(tmp_path, {"trainer_nodes": 2, "trainer_procs": 2, "trainer_gpus": [4, 5, 6, 7]}))
    assert up.trainer_ranks == 4
    assert up.trainer_env(0) == {"CUDA_VISIBLE_DEVICES": "4,5"} and up.trainer_env(1) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    fits = {
        "engine": "vllm",
        "inference_tensor_parallel_size": 2,
        "inference_gpus": [[0, 1]],
        "trainer_sharding": "fsdp",
    }
    assert UpConfig.from_file(write(tmp_path, fits)).inference_tensor_parallel_size == 2


def test_torchrun_flags_of_one_and_of_several_nodes():
    assert torchrun_argv(1) == []
    assert torchrun_argv(2) == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    several = torchrun_argv(2, 3, "127.0.0.1:2900", "rid")
    assert several == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:2900",
        "--rdzv-id",
        "rid",
        "--local-addr",
        "127.0.0.1",
    ]
    with pytest.raises(ValueError, match="rendezvous endpoint and id"):
        torchrun_argv(1, 2)


def test_fleetrl_up_starts_one_agent_per_trainer_node_sharing_one_rendezvous_and_ready_file(tmp_path, monkeypatch):
    started = []

    class FakePopen:  # records the command line; no process is started
        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs["env"]))
            self.pid = 0

    monkeypatch.setattr("fleetrl.up.supervisor.subprocess.Popen", FakePopen)
    up = UpConfig.from_file(write(tmp_path, {"trainer_nodes": 2, "trainer_procs": 1, "trainer_gpus": [3, 5]}))
    children = start_trainer(Supervisor(tmp_path / "logs"), up, ["--x"], {"OMP_NUM_THREADS": "1"})
    assert [c.name for c in children] == ["trainer-node0", "trainer-node1"] and {c.kind for c in children} == {
        "trainer"
    }
    (node0, env0), (node1, env1) = started
    assert node0 == node1  # the same agent command line: c10d numbers the nodes by arrival
    head = node0.index("-m", 2)
    assert node0[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert node0[head:] == ["-m", "fleetrl", "serve", "trainer", "--x", "--ready-file", str(children[0].ready_file)]
    assert children[0].ready_file == children[1].ready_file == tmp_path / "logs" / "ready" / "trainer.json"
    assert node0[node0.index("--nnodes") + 1] == "2" and node0[node0.index("--rdzv-backend") + 1] == "c10d"
    assert node0[node0.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
    assert (env0["CUDA_VISIBLE_DEVICES"], env1["CUDA_VISIBLE_DEVICES"]) == ("3", "5")
    assert env0["OMP_NUM_THREADS"] == env1["OMP_NUM_THREADS"] == "1"

    one = UpConfig.from_file(write(tmp_path, {"trainer_procs": 2}))
    (single,) = start_trainer(Supervisor(tmp_path / "one"), one, ["--x"], {})
    assert single.name == "trainer" and "--standalone" in started[-1][0]


def test_mesh_shape_of_each_sharding():
    assert mesh_shape("fsdp", 4, 2) == (4,)
    assert mesh_shape("hsdp", 4, 2) == (2, 2)  # replicate across 2 nodes, shard within each
    assert mesh_shape("hsdp", 6, 3) == (2, 3)
    with pytest.raises(ValueError, match="4 ranks do not split into nodes of 3 ranks"):
        mesh_shape("hsdp", 4, 3)
    with pytest.raises(ValueError, match="'zero3' is not one of fsdp, hsdp"):
        mesh_shape("zero3", 4, 2)


def test_dist_context_reads_the_node_size_from_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ctx = DistContext.from_env(sharding="hsdp")  # world 1: no process group
    assert not ctx.enabled and ctx.local_world_size == 1 and ctx.mesh_shape == (1, 1)
    assert DistContext(world_size=4, local_world_size=2, sharding="hsdp").mesh_shape == (2, 2)
    assert DistContext(world_size=4).mesh_shape == (4,)


def test_waiting_for_the_trainer_fails_when_another_of_its_nodes_exits(tmp_path):
    sup = Supervisor(tmp_path)
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        node0 = Child("trainer-node0", "trainer", [], tmp_path / "0.log", waiting, tmp_path / "ready" / "trainer.json")
        node1 = Child("trainer-node1", "trainer", [], tmp_path / "1.log", crashed)
        with pytest.raises(
            ServiceFailed, match="trainer-node0 did not become ready: trainer-node1 exited with code 3"
        ) as exc:
            sup.wait_ready(node0, timeout_s=100, peers=[node1])
        assert exc.value.child is node1  # its log tail is the one shown
    finally:
        waiting.kill()
        waiting.wait()


def test_the_trainer_takes_its_sharding_as_a_flag():
    from fleetrl.services.trainer.launcher import build_parser, config_from_args

    base = ["--set", "base_model='m'", "--set", "kl_beta=0"]
    assert config_from_args(build_parser().parse_args(base)).sharding == "fsdp"
    assert config_from_args(build_parser().parse_args([*base, "--sharding", "hsdp"])).sharding == "hsdp"
