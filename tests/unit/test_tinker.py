"""fleetrl.tinker: Tinker-style envs (written here, duck-typed like tinker-cookbook's) run through a scripted
sampler (the real Sampler class, its replica a script), and through the gateway's row processing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from fleetrl import Config, RolloutRun, RolloutSetup
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import NoReplicaError, Sampler
from fleetrl.gateway.worker import Gateway
from fleetrl.services.inference.engine import Completion, SamplingRequest
from fleetrl.step_metrics import sample_metrics
from fleetrl.tinker import builder_from_dataset, dataset_rows, run_group, stop_arguments, tinker_rollout_fn
from fleetrl.v1 import controller_pb2
from tests.controller_standin import RecordingController


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class ScriptedSampler(Sampler):
    """Answers 'abcd' (tokens 0..3) to every prompt; records the requests."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        super().__init__(CharTokenizer())
        self.requests: list[SamplingRequest] = []
        self.fail_with = fail_with

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        self.requests.append(request)
        if self.fail_with is not None:
            raise self.fail_with
        prompt_len = len(request.prompt_token_ids)
        return [Completion([0, 1, 2, 3], [-0.25] * 4, "length", prompt_len, [2] * 4) for _ in range(request.n)]


@dataclass
class ModelInput:
    """tinker.ModelInput's shape, enough for the adapter: `to_ints()`."""

    tokens: list[int]

    def to_ints(self) -> list[int]:
        return list(self.tokens)


@dataclass
class StepResult:
    reward: float
    episode_done: bool
    next_observation: Any
    next_stop_condition: list
    metrics: dict = field(default_factory=dict)


class CountingEnv:
    """Two turns; turn 2's observation extends turn 1 (append-only chat) unless `rewrite`. Reward: step index."""

    def __init__(self, prompt: list[int], rewrite: bool = False, fail: bool = False) -> None:
        self.prompt, self.rewrite, self.fail, self.turn = prompt, rewrite, fail, 0

    async def initial_observation(self):
        return ModelInput(self.prompt), ["c"]  # a string stop condition: the sampler cuts after "c"

    async def step(self, action: list[int], *, extra: dict | None = None) -> StepResult:
        if self.fail:
            raise ValueError("env broke")
        self.turn += 1
        assert extra == {"stop_reason": "stop"}
        ob = [9, 9] if self.rewrite else [*self.prompt, *action, 8]
        return StepResult(float(self.turn), self.turn == 2, ModelInput(ob), ["c"], {"turn": self.turn})


class PairwiseBuilder:
    """compute_group_rewards sees the whole group: +1 to member 0, -1 to the others (a pairwise judge's shape)."""

    def __init__(self, n: int = 3, **env_kwargs: Any) -> None:
        self.n, self.env_kwargs, self.calls, self.cleaned = n, env_kwargs, [], False

    async def make_envs(self):
        fail = self.env_kwargs.pop("fail_member", None)
        return [CountingEnv([5, 6], fail=(i == fail), **self.env_kwargs) for i in range(self.n)]

    async def compute_group_rewards(self, trajectory_group, env_group):
        self.calls.append(len(trajectory_group))
        assert all(len(t.transitions) == 2 and t.transitions[0].ac.tokens == [0, 1, 2] for t in trajectory_group)
        return [(1.0 if i == 0 else -1.0, {"judge": float(i)}) for i in range(len(trajectory_group))]

    def logging_tags(self):
        return ["count", "toy"]

    async def cleanup(self):
        self.cleaned = True


async def test_group_rewards_see_the_whole_group_and_add_to_the_step_rewards():
    sampler, builder = ScriptedSampler(), PairwiseBuilder(3)
    results = await run_group(builder, sampler, {"max_tokens": 8}, 3)
    assert builder.calls == [3] and builder.cleaned
    assert [r.reward for r in results] == [4.0, 2.0, 2.0]  # steps 1 + 2, then +1 / -1 from the group
    assert all(req.stop_token_ids == () for req in sampler.requests)
    (sample,) = results[0].to_samples()  # turn 2 extends turn 1: one sample, two assistant turns
    assert sample.tokens == [5, 6, 0, 1, 2, 8, 0, 1, 2]
    assert sample.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1, 1] and sample.finish_reason == "stop"
    sample.validate()


async def test_logging_tags_become_env_tag_metrics_in_the_step():
    results = await run_group(PairwiseBuilder(2), ScriptedSampler(), {}, 2)
    metrics = results[1].metrics
    assert metrics["reward/total"] == 2.0 and metrics["env/toy/judge"] == 1.0 and metrics["env/count/turn"] == 2.0
    step = sample_metrics([s for r in results for s in r.to_samples()])
    assert step["env/toy/reward/total"] == 3.0 and step["env/all/reward/total"] == 3.0  # (4 + 2) / 2
    assert "env/all/env/toy/judge" not in step


async def test_a_rewritten_observation_starts_a_new_sample():
    (run,) = await run_group(PairwiseBuilder(1, rewrite=True), ScriptedSampler(), {}, 1)
    assert [s.tokens for s in run.to_samples()] == [[5, 6, 0, 1, 2], [9, 9, 0, 1, 2]]


async def test_a_failing_env_is_left_out_of_the_group_rewards_and_an_outage_raises():
    builder = PairwiseBuilder(3, fail_member=1)
    results = await run_group(builder, ScriptedSampler(), {}, 3)
    assert builder.calls == [2] and isinstance(results[1], ValueError)
    assert isinstance(results[0], RolloutRun) and isinstance(results[2], RolloutRun)
    builder = PairwiseBuilder(2)
    with pytest.raises(NoReplicaError):
        await run_group(builder, ScriptedSampler(fail_with=NoReplicaError("none")), {}, 2)
    assert builder.cleaned
    with pytest.raises(ValueError, match="made 3 envs but completions_per_prompt is 2"):
        await run_group(PairwiseBuilder(3), ScriptedSampler(), {}, 2)


def test_stop_conditions_and_dataset_rows():
    assert stop_arguments(["</a>"]) == {"stop": ["</a>"]} and stop_arguments([7]) == {"stop_token_ids": (7,)}
    assert stop_arguments([]) == {}

    class Dataset:
        def __len__(self) -> int:
            return 2

        def get_batch(self, index: int) -> list[str]:
            return [f"b{index}g{j}" for j in range(3)]

    rows = dataset_rows(Dataset())
    assert len(rows) == 6 and builder_from_dataset(Dataset())(rows[4]) == "b1g1"


async def test_the_gateway_runs_one_builder_per_row_with_seeds_per_member():
    sampler = ScriptedSampler()
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=3, seed=4)
    setup = RolloutSetup(sampler=sampler, completions_per_prompt=3)
    builders: list[PairwiseBuilder] = []

    def builder_for_row(row: dict) -> PairwiseBuilder:
        builders.append(PairwiseBuilder(row["n"]))
        return builders[-1]

    settings = GatewayConfig(run=run, rollout="unused:unused")
    factory = lambda _: tinker_rollout_fn(setup, builder_for_row)  # noqa: E731 - the rollout over this test's setup
    gateway = Gateway(settings, rollout_factory=factory, controller=RecordingController())
    await gateway.prepare_rollouts()
    await gateway.process_row(controller_pb2.LeasedRow(row_id=2, submit_version=0, attempt=1, row_json='{"n": 3}'))
    assert len(builders) == 1 and builders[0].calls == [3]
    assert list(gateway.stub.reports[0].rewards) == [4.0, 2.0, 2.0]
    seeds = [r.sequence_seed(i) for r in sampler.requests for i in range(r.n)]  # merged calls carry `seeds`
    assert len(set(seeds)) == 6 and None not in seeds  # 3 members x 2 turns, each call its own seed


class Overflow:
    """tinker's InitialObservationOverflow: the prompt is already too long; no sampling."""

    reward, metrics = -1.0, {"stop/max_tokens": 1.0}


class OverflowBuilder(PairwiseBuilder):
    async def make_envs(self):
        envs = [CountingEnv([5, 6]) for _ in range(self.n)]

        async def overflow():
            return Overflow()

        envs[0].initial_observation = overflow  # type: ignore[method-assign]
        return envs

    async def compute_group_rewards(self, trajectory_group, env_group):
        self.calls.append(len(trajectory_group))
        return [(0.0, {}) for _ in trajectory_group]


async def test_an_overflowed_prompt_is_shown_to_the_group_rewards_but_trains_nothing():
    sampler, builder = ScriptedSampler(), OverflowBuilder(2)
    results = await run_group(builder, sampler, {}, 2)
    assert builder.calls == [2] and results[0] is None and isinstance(results[1], RolloutRun)
    assert len(sampler.requests) == 2  # only the other member sampled (two turns)
