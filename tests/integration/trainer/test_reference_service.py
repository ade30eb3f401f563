"""The reference service as a real process: its logprobs over gRPC equal the policy trainer's own forward on the
base weights (batched concurrent requests, temperature included); bad requests are refused with the reason;
/metrics counts; and the trainer's KL against it is 0 at step 1."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
import torch

from fleetrl.clients.reference import ReferenceClient
from fleetrl.rpc import check_health, open_channel
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.model import load_causal_lm, target_logprobs
from fleetrl.trainer.reference_source import make_reference_fn
from tests.integration.trainer.conftest import service_process
from tests.unit.trainer.helpers import make_cfg, tiny_groups

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    args = ["reference", "--model", tiny_model_dir, "--grpc-port", "0", "--metrics-port", "0", "--batch-wait-ms", "20"]
    with service_process(args, workdir, "reference") as info:
        yield info


def _trainer_forward(model, tokens: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logprobs, _ = target_logprobs(model, ids[:, :-1], ids[:, 1:], temperature=temperature)
    return logprobs[0].tolist()


def test_logprobs_equal_the_trainer_forward_on_base_weights(reference, tiny_model_dir):
    address = f"127.0.0.1:{reference['grpc_port']}"
    sequences = [[5, 9, 200, 31, 7], [1, 2], [300, 301, 302, 303, 304, 305, 306, 307, 308], [44, 45, 46]]

    async def call_all():
        async with ReferenceClient(address) as client:
            plain = await asyncio.gather(*(client.compute_logprobs([s]) for s in sequences))
            hot = await client.compute_logprobs(sequences[:2], temperature=0.7)
            channel = open_channel(address)
            health = await check_health(channel)
            await channel.close()
            return [p[0] for p in plain], hot, health, await client.status()

    plain, hot, health, status = asyncio.run(call_all())
    model = load_causal_lm(tiny_model_dir)  # the trainer's model, as it loads it (train mode)
    for seq, got in zip(sequences, plain, strict=True):
        assert len(got) == len(seq) - 1
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(_trainer_forward(model, seq, 1.0)), atol=1e-5, rtol=0
        )
    for seq, got in zip(sequences[:2], hot, strict=True):
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(_trainer_forward(model, seq, 0.7)), atol=1e-5, rtol=0
        )
    assert health == "SERVING"
    assert status.requests >= 5 and status.sequences >= 6


def test_bad_requests_are_refused_with_the_reason(reference):
    address = f"127.0.0.1:{reference['grpc_port']}"

    async def call(sequences, temperature=1.0):
        async with ReferenceClient(address) as client:
            return await client.compute_logprobs(sequences, temperature)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call([[1, 2, 3], [4]]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequences[1] has 1 tokens" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError, match="outside the vocabulary"):
        asyncio.run(call([[1, 10**6]]))
    with pytest.raises(grpc.aio.AioRpcError, match="temperature"):
        asyncio.run(call([[1, 2]], temperature=-1.0))
    body = urllib.request.urlopen(f"http://127.0.0.1:{reference['metrics_port']}/metrics", timeout=10).read().decode()
    assert 'fleetrl_reference_requests_total{outcome="invalid"} 3.0' in body
    assert "fleetrl_reference_tokens_total" in body


def test_trainer_kl_against_the_reference_service_is_zero_at_step_one(reference, tiny_model_dir, tmp_path):
    cfg = make_cfg(tiny_model_dir, tmp_path, kl_beta=0.1, temperature=0.9)
    ref_fn = make_reference_fn(
        f"127.0.0.1:{reference['grpc_port']}", cfg, auth_token=None, timeout_s=30.0, device="cpu"
    )
    trainer = PolicyTrainer(cfg, ref_logprobs_fn=ref_fn)
    result = trainer.train_step(tiny_groups(tiny_model_dir, num_groups=2, temperature=0.9))
    trainer.close()
    assert result.metrics["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert result.metrics["perf/ref_forward_time"] > 0
    second = PolicyTrainer(cfg, ref_logprobs_fn=ref_fn)
    second.train_step(tiny_groups(tiny_model_dir, num_groups=2, temperature=0.9))
    moved = second.train_step(tiny_groups(tiny_model_dir, num_groups=2, seed=5, first_row_id=10))
    assert moved.metrics["train/kl_ref"] > 1e-6  # after an update the policy has left the reference
