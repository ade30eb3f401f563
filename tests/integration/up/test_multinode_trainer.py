"""The trainer as 2 "nodes" on one machine: `fleetrl up` with `trainer_nodes = 2` starts two torchrun agents that
meet through a c10d rendezvous on loopback (gloo), and the run ends with the weights of the same run on 1 node x 2
ranks; the checkpoint the 2 nodes saved resumes on 1 rank.

The run settings are those of test_determinism.py (synchronous, seeded sampling, one sequence per decode), under
which two runs of one layout end at the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.checkpoint import latest_checkpoint
from fleetrl.up.config import load_run_and_up
from tests.integration.up.conftest import fleetrl_up, read_metrics, write_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3
RUN = {"max_steps": STEPS, "synchronous_training": True, "dcp_save_interval": 1, "learning_rate": 3e-4}
UP = {"inference_args": ["--max-num-seqs", "1"]}


def run_to_the_end(tmp_path: Path, model_dir: str, layout: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = write_run(tmp_path, model_dir, RUN, {**UP, **layout})
    result = fleetrl_up(config)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["optim/grad_norm"] > 0 for m in metrics)
    return tmp_path / "run"


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_two_trainer_nodes_end_with_the_weights_of_one_node_of_two_ranks(tmp_path, tiny_model_dir):
    one_node = run_to_the_end(tmp_path / "one", tiny_model_dir, {"trainer_procs": 2})
    two_nodes = run_to_the_end(tmp_path / "two", tiny_model_dir, {"trainer_nodes": 2, "trainer_procs": 1})

    logs = [(two_nodes / f"trainer-node{i}.log").read_text() for i in range(2)]
    for log in logs:
        argv = log.splitlines()[0]
        assert "torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d" in argv, argv
    assert sum("rank 1/2: process group up (gloo); fsdp mesh [2]" in log for log in logs) == 1
    assert not (two_nodes / "trainer.log").exists()

    final = load_file(str(two_nodes / "final" / "model.safetensors"))
    base = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    assert max_difference({k: v for k, v in final.items() if k in base}, base) > 5e-4  # it trained
    # Bitwise equal in practice (the same world of 2 gloo ranks); a 1-rank run of these settings ends ~4e-7 away.
    assert max_difference(final, load_file(str(one_node / "final" / "model.safetensors"))) <= 1e-7

    # The 2-node DCP checkpoint of the last step loads into 1 rank (resharded) with its state.
    run, _, _ = load_run_and_up(tmp_path / "two" / "run.json", [])
    checkpoint = latest_checkpoint(two_nodes / "checkpoints")
    assert checkpoint is not None
    resumed = PolicyTrainer(run)
    assert resumed.resume(checkpoint) and resumed.version == STEPS
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, final[name], atol=0, rtol=0, msg=name)


def test_hsdp_across_two_trainer_nodes_of_two_ranks(tmp_path, tiny_model_dir):
    layout = {"trainer_nodes": 2, "trainer_procs": 2, "trainer_sharding": "hsdp"}
    run_dir = run_to_the_end(tmp_path, tiny_model_dir, layout)
    logs = "".join((run_dir / f"trainer-node{i}.log").read_text() for i in range(2))
    for rank in range(4):
        assert f"rank {rank}/4: process group up (gloo); hsdp mesh [2, 2]" in logs
    assert "--sharding hsdp" in logs.splitlines()[0]
