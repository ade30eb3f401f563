"""`fleetrl sft` across FSDP2 ranks and across a restart (issue 44 item 2): two gloo ranks train the same rows to the
same weights as one process, and a run stopped after 2 steps and resumed to 4 ends where an uninterrupted 4-step
run ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fleetrl.commands.sft import main as sft_main
from tests.integration.trainer.rank_env import end_rank

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def write_config(tmp_path: Path, model_dir: str, log_name: str) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"{a} + {a} =", "completion": f" {2 * a}"}) + "\n" for a in range(12))
    )
    path = tmp_path / f"{log_name}.toml"
    path.write_text(
        f"""[run]
base_model = {json.dumps(model_dir)}
log_path = {json.dumps(str(tmp_path / log_name))}
max_steps = 4
learning_rate = 1e-3
max_seq_len = 48
max_completion_tokens = 8

[sft]
dataset = {json.dumps(str(rows))}
batch_size = 4
"""
    )
    return path


def _rank(rank: int, port: int, config: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    assert sft_main([config, "--device", "cpu"]) == 0
    end_rank()


def exported(tmp_path: Path, log_name: str) -> dict[str, torch.Tensor]:
    return load_file(tmp_path / log_name / "final" / "model.safetensors")


def losses(tmp_path: Path, log_name: str) -> list[float]:
    lines = (tmp_path / log_name / "metrics.jsonl").read_text().splitlines()
    return [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]


def test_two_fsdp2_ranks_train_the_rows_as_one_process_does(tiny_model_dir, tmp_path, free_port):
    mp.spawn(_rank, args=(free_port, str(write_config(tmp_path, tiny_model_dir, "ranks"))), nprocs=2, join=True)
    assert sft_main([str(write_config(tmp_path, tiny_model_dir, "single")), "--device", "cpu"]) == 0
    assert losses(tmp_path, "ranks") == pytest.approx(losses(tmp_path, "single"), rel=1e-4)
    single = exported(tmp_path, "single")
    for name, value in exported(tmp_path, "ranks").items():
        torch.testing.assert_close(value, single[name], atol=2e-5, rtol=1e-4, msg=name)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_model_dir, tmp_path):
    straight = str(write_config(tmp_path, tiny_model_dir, "straight"))
    assert sft_main([straight, "--device", "cpu"]) == 0
    stopped = str(write_config(tmp_path, tiny_model_dir, "stopped"))
    assert sft_main([stopped, "--device", "cpu", "--set", "max_steps=2"]) == 0
    assert sft_main([stopped, "--device", "cpu", "--resume"]) == 0
    assert losses(tmp_path, "stopped") == pytest.approx(losses(tmp_path, "straight"), rel=1e-5)
    reference = exported(tmp_path, "straight")
    for name, value in exported(tmp_path, "stopped").items():
        torch.testing.assert_close(value, reference[name], atol=1e-6, rtol=1e-5, msg=name)
