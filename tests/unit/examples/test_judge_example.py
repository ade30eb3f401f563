"""examples/judge: its run.toml is a valid `fleetrl up` config with a judge pool, and its rollout rewards the policy
for agreeing with the judge's greedy answer (asked once per problem, shared by the group), reports the true
accuracy beside it, and refuses to run without a judge pool."""

from __future__ import annotations

import pytest

from fleetrl import Config, RolloutSetup
from fleetrl.up.config import UpConfig
from fleetrl.user_code import load_object
from tests.unit.examples.helpers import EXAMPLES, ScriptedSampler

PATH = EXAMPLES / "judge" / "run.toml"


def test_the_judge_example_config_loads() -> None:
    run, up = Config.from_toml(PATH), UpConfig.from_file(PATH)
    assert up.judge_model == "runs/arithmetic/final" and up.judge_replicas == 1
    assert run.base_model == "runs/arithmetic/init/model"
    for spec in (up.rollout, up.evaluation):
        assert (PATH.parent / str(spec).rpartition(":")[0]).is_file()


async def test_the_reward_is_agreement_with_the_judge(tokenizer) -> None:
    up = UpConfig.from_file(PATH)
    factory = load_object(f"{PATH.parent / up.rollout.rpartition(':')[0]}:make_rollout_fn")
    eos = tokenizer.eos_token_id

    def answer(text: str):
        return lambda prompt: [*tokenizer.encode(text), eos]

    policy = ScriptedSampler(tokenizer, answer("86"))
    judge = ScriptedSampler(tokenizer, answer("86"))  # the judge is wrong (37+48 = 85): agreement is what pays
    setup = RolloutSetup(tokenizer=tokenizer, sampler=policy, sample_kwargs={"max_tokens": 5, "temperature": 1.0})
    setup.judge_sampler = judge
    rollout = factory(setup)
    row = {"prompt": "37+48=", "answer": "85"}
    samples = [await rollout(row) for _ in range(3)]
    assert [s.reward for s in samples] == [1.0, 1.0, 1.0]
    assert samples[0].metrics == {"judged": 1.0, "judge_correct": 0.0, "correct": 0.0}
    assert len(judge.prompts) == 1 and judge.kwargs[0]["temperature"] == 0.0  # asked once, greedily
    with pytest.raises(RuntimeError, match="judge_model"):
        factory(RolloutSetup(tokenizer=tokenizer, sampler=policy))
