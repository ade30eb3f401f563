"""The gateway's side of the rollout contract (no sockets): context keyword arguments, group rollouts, an unknown
return type stopping the gateway, and incomplete groups run again."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fleetrl import Config, RolloutRun, RolloutSample, RolloutSegment
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.worker import Gateway
from fleetrl.rollout import RolloutReturnTypeError, group_rollout
from fleetrl.v1 import controller_pb2
from tests.controller_standin import RecordingController


def sample(reward: float) -> RolloutSample:
    return RolloutSample([1, 2, 3], [0.0, -0.1, -0.2], [0, 1, 1], reward)


async def gateway_for(rollout_fn: Any, **run: Any) -> Gateway:
    cfg = Config(base_model="unused", dataset=run.pop("dataset", "unused"), **{"completions_per_prompt": 4, **run})
    settings = GatewayConfig(run=cfg, rollout="unused:unused")
    gateway = Gateway(settings, rollout_factory=lambda setup: rollout_fn, controller=RecordingController())
    await gateway.prepare_rollouts()
    return gateway


def leased(row_id: int = 7, **row: Any) -> Any:
    return controller_pb2.LeasedRow(row_id=row_id, submit_version=3, attempt=1, row_json=json.dumps(row))


async def test_a_rollout_receives_the_context_arguments_it_declares(tmp_path):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(3)))
    seen: list[dict[str, Any]] = []

    async def rollout_fn(row: dict, *, cursor_index: int, epoch: int, rollout_idx: int, evaluation: bool) -> Any:
        seen.append({"cursor_index": cursor_index, "epoch": epoch, "rollout_idx": rollout_idx, "eval": evaluation})
        return sample(float(rollout_idx))

    gateway = await gateway_for(rollout_fn, dataset=str(dataset))
    await gateway.process_row(leased(row_id=7))  # 3 rows: row id 7 is epoch 2, dataset index 1
    assert sorted(s["rollout_idx"] for s in seen) == [0, 1, 2, 3]
    assert all(s["cursor_index"] == 1 and s["epoch"] == 2 and s["eval"] is False for s in seen)
    assert list(gateway.stub.reports[0].rewards) == [0.0, 1.0, 2.0, 3.0]


async def test_a_rollout_receives_the_current_cookbooks_context_arguments(tmp_path):
    # The cookbook (#570) passes row_index, sample_index and end_of_epoch; a rollout that requires them failed
    # every call before (TypeError: missing keyword-only arguments).
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(3)))
    seen: list[tuple[int, int, int, bool]] = []

    async def rollout_fn(row: dict, *, row_index: int, sample_index: int, end_of_epoch: bool) -> Any:
        seen.append((row["i"], row_index, sample_index, end_of_epoch))
        return sample(float(sample_index))

    gateway = await gateway_for(rollout_fn, dataset=str(dataset))
    await gateway.process_row(leased(row_id=7, i=1))  # 3 rows: row id 7 is epoch 2, index 1
    await gateway.process_row(leased(row_id=5, i=2))  # epoch 1's last row
    assert sorted(seen) == [(1, 1, k, False) for k in range(4)] + [(2, 2, k, True) for k in range(4)]
    assert [list(r.rewards) for r in gateway.stub.reports] == [[0.0, 1.0, 2.0, 3.0]] * 2

    async def kwargs_fn(row: dict, **context: Any) -> Any:
        seen.append(context)
        return sample(1.0)

    seen.clear()
    await (await gateway_for(kwargs_fn, dataset=str(dataset))).process_row(leased(row_id=3))
    assert {"row_index": 0, "sample_index": 0, "end_of_epoch": False, "cursor_index": 0}.items() <= seen[0].items()


async def test_dataset_context_arguments_without_a_dataset_fail_naming_them():
    async def rollout_fn(row: dict, *, end_of_epoch: bool) -> Any:
        return sample(1.0)

    with pytest.raises(ValueError, match=r"takes end_of_epoch needs run\.dataset"):
        await gateway_for(rollout_fn, dataset=None)


async def test_an_unknown_return_type_stops_the_gateway_naming_it():
    async def rollout_fn(row: dict) -> Any:
        return {"tokens": [1, 2, 3], "reward": 1.0}  # a dict, not a RolloutSample

    gateway = await gateway_for(rollout_fn)
    with pytest.raises(RolloutReturnTypeError, match=r"builtins\.dict"):
        await gateway.process_row(leased())
    assert gateway.stub.reports == []  # nothing reported as if the row were merely rejected


async def test_a_group_rollout_is_called_once_for_the_whole_group():
    calls: list[int] = []

    @group_rollout
    async def rollout_fn(row: dict, n: int) -> list[Any]:
        calls.append(n)
        # Rewards relative to the group: only possible when the whole group is seen at once.
        raw = [float(i) for i in range(n)]
        mean = sum(raw) / n
        return [RolloutRun([RolloutSegment([1, 2], [0.0, -0.1], [0, 1])], r - mean) for r in raw]

    gateway = await gateway_for(rollout_fn)
    await gateway.process_row(leased())
    assert calls == [4]
    assert list(gateway.stub.reports[0].rewards) == [-1.5, -0.5, 0.5, 1.5]


async def test_a_group_rollout_returning_the_wrong_count_stops_the_gateway():
    @group_rollout
    async def rollout_fn(row: dict, n: int) -> list[Any]:
        return [sample(1.0)]

    with pytest.raises(RolloutReturnTypeError, match="list of 4 results, got list of 1"):
        await (await gateway_for(rollout_fn)).process_row(leased())


async def test_members_of_an_incomplete_group_run_again_up_to_the_retry_limit():
    attempts: dict[int, int] = {}

    async def rollout_fn(row: dict, *, rollout_idx: int) -> Any:
        attempts[rollout_idx] = attempts.get(rollout_idx, 0) + 1
        if rollout_idx in (1, 2) and attempts[rollout_idx] % 2 == 1:  # 1 and 2 fail their first attempt
            return None
        return sample(float(rollout_idx % 2))

    gateway = await gateway_for(rollout_fn, min_group_size=4, max_incomplete_group_retries=1)
    await gateway.process_row(leased())
    assert attempts == {0: 1, 1: 2, 2: 2, 3: 1}  # only the failed members ran again
    assert gateway.stub.reports[0].samples == 4 and gateway.counters["group_retries"] == 1

    attempts.clear()
    no_retry = await gateway_for(rollout_fn, min_group_size=4)
    await no_retry.process_row(leased())
    assert no_retry.stub.reports[0].outcome == controller_pb2.REJECTED
    assert "need 4" in no_retry.stub.reports[0].reason
