"""A LoRA policy trainer as a real process: kl_beta > 0 with no --reference (the adapter-disabled base is the
reference), groups over ZeroMQ, TrainStep over gRPC, only the adapter on the weight stream (its bytes = the
adapter's parameters x 4), and Finish exporting a PEFT adapter folder."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.group_stream import GroupSender
from fleetrl.rpc import open_channel
from fleetrl.trainer.model import load_causal_lm
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from fleetrl.weights.fetch import fetch_weights
from tests.integration.trainer.conftest import service_process
from tests.unit.trainer.helpers import tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_TOML = """\
base_model = "{model}"
log_path = "{log}"
completions_per_prompt = 4
prompt_groups_per_step = 2
max_completion_tokens = 16
max_seq_len = 64
learning_rate = 1e-2
kl_beta = 0.1
lora_rank = 4
lora_alpha = 16
max_head_offpolicy_versions = 1
"""


async def _call(address: str, method: str, request):
    channel = open_channel(address)
    try:
        return await getattr(trainer_pb2_grpc.TrainerStub(channel), method)(request, timeout=60)
    finally:
        await channel.close()


def test_a_lora_trainer_pushes_only_its_adapter(tiny_model_dir, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML.format(model=tiny_model_dir, log=tmp_path / "run"))
    ports = ["--grpc-port", "0", "--groups-port", "0", "--weights-port", "0", "--no-metrics"]
    groups = tiny_groups(tiny_model_dir, num_groups=4)
    with service_process(["trainer", "--config", str(toml), *ports], tmp_path, "trainer") as info:
        address = f"127.0.0.1:{info['grpc_port']}"
        with GroupSender(info["groups_address"]) as sender:
            for g in groups:
                sender.send(g)
        steps = []
        for step, rows in ((1, [0, 1]), (2, [2, 3])):
            request = trainer_pb2.TrainStepRequest(step=step, row_ids=rows, wait_timeout_s=30)
            steps.append(asyncio.run(_call(address, "TrainStep", request)))
        assert [s.version for s in steps] == [1, 2] and all(s.published for s in steps)
        assert steps[1].metrics["train/kl_ref"] > 0  # a reference without a reference service

        manifest, tensors = fetch_weights(info["weights_address"], 2, timeout_s=60)
        finish = asyncio.run(_call(address, "Finish", trainer_pb2.FinishRequest()))

    assert manifest.is_adapter and manifest.adapter["r"] == 4 and manifest.adapter["lora_alpha"] == 16
    assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
    # Independently of PEFT: r x (in + out) parameters per linear layer of the decoder, 4 bytes each (float32).
    base = load_causal_lm(tiny_model_dir, trainable=False)
    linears = [m for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert manifest.total_bytes == sum(4 * (m.in_features + m.out_features) for m in linears) * 4
    assert len(tensors) == 2 * len(linears)
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    assert manifest.total_bytes < full_bytes / 4

    export = tmp_path / "run" / "final"
    assert finish.export_path == str(export)
    assert json.loads((export / "adapter_config.json").read_text())["r"] == 4
    exported = load_file(export / "adapter_model.safetensors")
    assert set(exported) == set(tensors)
