"""The policy trainer as a real process: groups over ZeroMQ (invalid ones dropped and counted), TrainStep over
gRPC (retries, late groups, missing groups), weights on the weight stream loaded by the inference server's hf
engine, /metrics, and the final HF export that the hf engine serves with the trainer's logprobs."""

from __future__ import annotations

import asyncio
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import zmq

from fleetrl.group_stream import GroupSender
from fleetrl.rollout import RolloutSample
from fleetrl.rpc import check_health, open_channel
from fleetrl.services.inference.engine import SamplingRequest
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.trainer.model import load_causal_lm, sequence_logprobs
from fleetrl.v1 import trainer_pb2, trainer_pb2_grpc
from tests.integration.trainer.conftest import service_process
from tests.unit.trainer.helpers import tiny_groups
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_TOML = """\
base_model = "{model}"
log_path = "{log}"
completions_per_prompt = 4
prompt_groups_per_step = 2
max_completion_tokens = 16
max_seq_len = 64
learning_rate = 1e-3
kl_beta = 0.0
weight_sync_interval = 1
max_head_offpolicy_versions = 1
"""


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("trainer")
    toml = workdir / "run.toml"
    toml.write_text(RUN_TOML.format(model=tiny_model_dir, log=workdir / "run"))
    ports = ["--grpc-port", "0", "--groups-port", "0", "--weights-port", "0", "--metrics-port", "0"]
    with service_process(["trainer", "--config", str(toml), *ports], workdir, "trainer") as info:
        info["workdir"] = workdir
        yield info


async def _train(address: str, step: int, row_ids: list[int], wait_s: float = 0.0) -> trainer_pb2.TrainStepResponse:
    channel = open_channel(address)
    try:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        request = trainer_pb2.TrainStepRequest(
            step=step, row_ids=row_ids, data_position=f'{{"cursor": {step}}}', wait_timeout_s=wait_s
        )
        return await stub.TrainStep(request, timeout=60)
    finally:
        await channel.close()


async def _rpc(address: str, method: str, request):
    channel = open_channel(address)
    try:
        return await getattr(trainer_pb2_grpc.TrainerStub(channel), method)(request, timeout=60)
    finally:
        await channel.close()


def test_groups_in_steps_trained_weights_out(trainer, tiny_model_dir):
    grpc_address = f"127.0.0.1:{trainer['grpc_port']}"
    groups = tiny_groups(tiny_model_dir, num_groups=4)
    groups[3].row_id = 99
    bad = RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, float("nan"), -1.0], loss_mask=[0, 1, 1], reward=1.0)
    groups[2].samples.append(bad)

    with GroupSender(trainer["groups_address"]) as sender:
        for g in groups[:3]:
            sender.send(g)
        sender.send(groups[0])  # a duplicate row: refused
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(trainer["groups_address"])
        raw.send(b"garbage")
        raw.close(linger=2000)

    first = asyncio.run(_train(grpc_address, 1, [0, 1], wait_s=10))
    assert (first.step, first.version, first.published) == (1, 1, True)
    assert first.weights_address == trainer["weights_address"] and first.metrics["data/samples"] == 8
    retry = asyncio.run(_train(grpc_address, 1, [0, 1]))
    assert retry.already_trained and retry.metrics["train/loss"] == first.metrics["train/loss"]

    # Row 99 is not sent yet: the step fails naming it and nothing is lost; then it arrives late.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_train(grpc_address, 2, [2, 99], wait_s=0.3))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "[99]" in info.value.details()

    # The step waits for row 99 (the trainer logs it), and only then does it arrive.
    log_path = Path(trainer["log_path"])
    logged_before = log_path.stat().st_size
    with ThreadPoolExecutor(1) as pool:
        second_call = pool.submit(asyncio.run, _train(grpc_address, 2, [2, 99], wait_s=60))

        def waiting_for_99() -> bool:
            return second_call.done() or "groups of rows [99]" in log_path.read_bytes()[logged_before:].decode()

        wait_until(waiting_for_99, 60, "the trainer's step 2 waiting for row 99")
        assert not second_call.done(), second_call.result()
        with GroupSender(trainer["groups_address"]) as s:
            s.send(groups[3])
        second = second_call.result(timeout=120)
    assert second.version == 2 and second.metrics["data/samples"] == 8  # row 2: 4 of 5 valid; row 99: 4

    status = asyncio.run(_rpc(grpc_address, "Status", trainer_pb2.TrainerStatusRequest()))
    assert (status.version, status.published_version, status.trained_rows, status.samples_dropped) == (2, 2, 4, 1)
    assert status.buffered_groups == 0

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{trainer['metrics_port']}/metrics", timeout=10).read().decode()
    for line in (
        'fleetrl_trainer_samples_dropped_total{field="logprobs"} 1.0',
        'fleetrl_trainer_messages_dropped_total{reason="malformed"} 1.0',
        "fleetrl_trainer_groups_duplicate_total 1.0",
        "fleetrl_trainer_version 2.0",
        "fleetrl_trainer_steps_total 2.0",
    ):
        assert line in metrics, line
    names = ("train_loss", "optim_grad_norm", "optim_entropy", "train_clip_frac", "perf_fwd_bwd_time")
    for name in (*names, "perf_weight_publish_time"):
        assert f"\nfleetrl_trainer_{name} " in metrics, name

    async def health() -> str:
        channel = open_channel(grpc_address)
        try:
            return await check_health(channel)
        finally:
            await channel.close()

    assert asyncio.run(health()) == "SERVING"


def test_published_and_exported_weights_serve_the_trainer_logprobs(trainer, tiny_model_dir):
    grpc_address = f"127.0.0.1:{trainer['grpc_port']}"
    finish = asyncio.run(_rpc(grpc_address, "Finish", trainer_pb2.FinishRequest(data_position='{"cursor": 2}')))
    assert finish.version == 2
    trained = load_causal_lm(finish.export_path)  # the trainer's exact weights, through save_pretrained
    request = SamplingRequest(prompt_token_ids=[5, 17, 42, 8], n=2, max_tokens=12, seed=7, ignore_eos=True)

    async def sample(engine: HFEngine, load_from: str | None = None):
        await engine.start()
        try:
            if load_from is not None:
                result = await engine.load_weights(2, load_from, timeout_s=30)
                assert result.version == 2
            return await engine.generate(request)
        finally:
            await engine.shutdown()

    streamed = asyncio.run(sample(HFEngine(tiny_model_dir), load_from=trainer["weights_address"]))
    exported = asyncio.run(sample(HFEngine(finish.export_path)))
    for a, b in zip(streamed, exported, strict=True):
        assert a.token_ids == b.token_ids and a.versions == [2] * len(a.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        full = request.prompt_token_ids + a.token_ids
        ours = sequence_logprobs(trained, [full])[0][len(request.prompt_token_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(ours), atol=1e-4, rtol=0)
    # And the trained policy is not the base one: the update reached the weights that were served.
    base = load_causal_lm(tiny_model_dir)
    assert not torch.equal(base.get_output_embeddings().weight, trained.get_output_embeddings().weight)
