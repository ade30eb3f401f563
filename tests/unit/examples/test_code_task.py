"""examples/code_task: the reward runs the model's program against the problem's unit tests in the sandbox: a
correct program scores 1, a wrong one less, one that loops, forks or does not import scores 0 and the run goes on;
the rollout trains the reply's tokens as the sampler returned them."""

from __future__ import annotations

import json

import pytest

from fleetrl import Config, RolloutSetup
from fleetrl.up.config import UpConfig
from fleetrl.user_code import load_object
from tests.unit.examples.helpers import EXAMPLES, ScriptedSampler, load_example_module

reward = load_example_module("code_task", "code_reward")
rollout = load_example_module("code_task", "rollout")
ROWS = [json.loads(line) for line in (EXAMPLES / "code_task" / "problems.jsonl").read_text().splitlines()]
ADD = next(row for row in ROWS if row["id"] == "add")


async def test_a_correct_program_scores_one_and_a_wrong_one_less() -> None:
    right, metrics = await reward.score_program("def add(a, b):\n    return a + b\n", ADD["tests"])
    assert right == 1.0 and metrics == {"tests_passed": 3.0, "program_imports": 1.0, "sandbox_stopped": 0.0}
    wrong, metrics = await reward.score_program("def add(a, b):\n    return abs(a) + b\n", ADD["tests"])
    assert wrong == pytest.approx(2 / 3) and metrics["tests_passed"] == 2.0  # add(-4, 4) gives 8


@pytest.mark.parametrize(
    ("code", "stopped"),
    [
        ("def add(a, b)\n    return a + b\n", 0.0),  # a syntax error: it does not import
        ("while True:\n    pass\n", 1.0),  # loops at import: the CPU limit ends it
        ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", 1.0),
        ("import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)\n", 0.0),  # no network
    ],
)
async def test_a_program_that_breaks_scores_zero(code: str, stopped: float) -> None:
    score, metrics = await reward.score_program(code, ADD["tests"], timeout_s=5.0, cpu_s=2.0)
    assert score == 0.0 and metrics["tests_passed"] == 0.0 and metrics["sandbox_stopped"] == stopped


def test_the_program_is_the_replys_first_code_block_else_the_reply() -> None:
    assert reward.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert reward.extract_code("def f(): return 1") == "def f(): return 1"


async def test_the_rollout_trains_the_reply_as_sampled_and_scores_it_in_the_sandbox(tokenizer) -> None:
    reply = "```python\ndef add(a, b):\n    return a + b\n```"
    generated = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
    sampler = ScriptedSampler(tokenizer, [generated])
    rollout_fn = rollout.make_rollout_fn(RolloutSetup(tokenizer=tokenizer, sampler=sampler))
    sample = await rollout_fn(ADD)
    (prompt,) = sampler.prompts
    assert sample.tokens == prompt + generated and sample.loss_mask == [0] * len(prompt) + [1] * len(generated)
    assert sample.reward == 1.0 and sample.metrics["solved"] == 1.0


def test_run_toml_loads_and_its_factory_builds(tokenizer) -> None:
    path = EXAMPLES / "code_task" / "run.toml"
    run, up = Config.from_toml(path), UpConfig.from_file(path)
    assert run.base_model == "runs/tiny_model" and (EXAMPLES.parent / run.dataset).is_file()
    module, _, attr = up.rollout.rpartition(":")
    factory = load_object(f"{path.parent / module}:{attr}")  # [up].rollout is relative to the toml's folder
    setup = RolloutSetup(tokenizer=tokenizer, sampler=ScriptedSampler(tokenizer, []), extras=dict(run.rollout_extras))
    assert callable(factory(setup))
    assert all(set(row) == {"id", "prompt", "tests"} and row["tests"] for row in ROWS)
