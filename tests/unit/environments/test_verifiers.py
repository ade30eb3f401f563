"""fleetrl.environments.verifiers: a verifiers (0.4.0) environment's episode runs with its own tasks, rubric and
multi-turn logic through a real agent session server (a scripted sampler behind it), and what the rollout returns is
exactly what the server generated, with the rubric's reward; a failing episode raises (a dropped, counted sample);
a bad environment name, row or taskset fails naming it."""

from __future__ import annotations

import json
import logging
import textwrap
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from fleetrl.environments import EnvironmentEpisodeError, environment_rollout, parse_environment
from fleetrl.environments.__main__ import main as environments_main
from fleetrl.environments.verifiers import load_env
from fleetrl.gateway.assembly import assemble_group
from tests.unit.environments.scripted import scripted_setup, trained_and_generated

pytest.importorskip("verifiers")
from tests.integration.up.conftest import REPO

EXAMPLE = REPO / "examples" / "verifiers_reverse"


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


async def run_rows(setup, spec: str, rows: list[dict], options: dict | None = None) -> list:
    rollout = environment_rollout(spec, options)(setup)
    try:
        return [await rollout(row) for row in rows]
    finally:
        await rollout.close()
        await setup.sessions.close()


@pytest.mark.usefixtures("example_on_path")
@pytest.mark.parametrize("first_reply_right", [False, True])
async def test_an_episode_trains_exactly_what_the_session_generated_with_the_rubrics_reward(
    tokenizer, tiny_model_dir, tmp_path, first_reply_right
):
    task = list(load_env("reverse_text").taskset)[3].data
    answer = task.answer
    replies = [answer] if first_reply_right else ["wrong words here", answer]
    record = tmp_path / "record.jsonl"
    setup = scripted_setup(tokenizer, tiny_model_dir, replies, record_path=str(record))
    (run,) = await run_rows(setup, "verifiers:reverse_text", [{"task_idx": 3}])
    assert run.reward == 1.0  # the rubric read the last reply: the words reversed
    assert run.metrics["vf_reversed_words"] == 1.0
    assert run.metrics["session_turns"] == (1.0 if first_reply_right else 2.0)  # the env's correction turn
    prompts = setup.sessions.sampler.prompts
    assert task.prompt in tokenizer.decode(prompts[0]) and task.system_prompt in tokenizer.decode(prompts[0])
    if not first_reply_right:
        assert "Not quite. Reverse these words" in tokenizer.decode(prompts[1])
    (line,) = [json.loads(x) for x in record.read_text().splitlines()]
    samples = [SimpleNamespace(**s) for s in line["samples"]]
    turns = [SimpleNamespace(**u) for u in line["turns"]]
    trained, generated = trained_and_generated(turns, samples)
    assert trained == generated and len(generated) > 0  # every trained token and logprob is one the server made
    assert trained_and_generated([], run.to_samples())[0] == trained


@pytest.mark.usefixtures("example_on_path")
async def test_a_wrong_answer_gets_the_rubrics_partial_reward(tokenizer, tiny_model_dir):
    first_word = next(iter(load_env("reverse_text").taskset)).data.answer.split()[0]
    setup = scripted_setup(tokenizer, tiny_model_dir, ["zzz", f"{first_word} x y"])
    (run,) = await run_rows(setup, "verifiers:reverse_text", [{"task_idx": 0}])
    assert run.reward == pytest.approx(1 / 3)


FAILING_ENV = """
import verifiers.v1 as vf


class Boom(vf.Task[vf.TaskData]):
    @vf.reward
    async def always_fails(self, task, trace) -> float:
        raise RuntimeError("the grader is down")


class BoomTaskset(vf.Taskset[Boom, vf.TasksetConfig]):
    def load(self):
        yield Boom(vf.TaskData(prompt="hi"), self.config.task)


__all__ = ["BoomTaskset"]
"""


async def test_a_failing_episode_raises_naming_the_error_and_is_counted_as_a_dropped_sample(
    tokenizer, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    (tmp_path / "boom_env.py").write_text(textwrap.dedent(FAILING_ENV))
    monkeypatch.syspath_prepend(str(tmp_path))
    setup = scripted_setup(tokenizer, tiny_model_dir, ["hello", "hello"])
    rollout = environment_rollout("verifiers:boom_env")(setup)
    try:
        with caplog.at_level(logging.WARNING, logger="fleetrl.environments"):
            for _ in range(2):
                with pytest.raises(EnvironmentEpisodeError, match="the grader is down"):
                    await rollout({"task_idx": 0})
        assert rollout.failures.counts == {"TaskError": 2}  # verifiers' error type is the reason counted
        said = [r.getMessage() for r in caplog.records if "an episode failed" in r.getMessage()]
        assert len(said) == 1 and "the grader is down" in said[0]  # each reason logged once, with its message
    finally:
        await rollout.close()
        await setup.sessions.close()
    # what the gateway does with it: the member is dropped and counted as an error
    assembled = assemble_group(0, 0, [EnvironmentEpisodeError("x"), None], min_samples=1)
    assert assembled.dropped["error"] == 1


@pytest.mark.usefixtures("example_on_path")
async def test_bad_names_and_rows_fail_naming_what_is_wrong(tokenizer, tiny_model_dir):
    for spec in ("verifier:reverse_text", "reverse_text", "verifiers:"):
        with pytest.raises(ValueError, match="environment"):
            parse_environment(spec)
    setup = scripted_setup(tokenizer, tiny_model_dir, [])
    with pytest.raises(ValueError, match=r"no_such_env.*not importable"):
        environment_rollout("verifiers:no_such_env")(setup)
    rollout = environment_rollout("verifiers:reverse_text", {"num_tasks": 4})(setup)
    try:
        for row in ({"task_idx": 4}, {"prompt": "x"}, {"task_idx": "0"}):
            with pytest.raises(ValueError, match="task_idx"):
                await rollout(row)
    finally:
        await rollout.close()
        await setup.sessions.close()


def test_the_rows_command_writes_one_row_per_task_and_the_shipped_rows_match(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = ["rows", "verifiers:reverse_text", str(out), "--path", str(EXAMPLE), "--options", '{"num_tasks": 5}']
    assert environments_main(argv) == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == [{"task_idx": i} for i in range(5)]
    shipped = (EXAMPLE / "rows.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in shipped] == [{"task_idx": i} for i in range(32)]  # run.toml's num_tasks = 32
    assert environments_main(["rows", "nope:x", str(out)]) == 2
    assert "environment = 'nope:x'" in capsys.readouterr().err


@pytest.mark.usefixtures("example_on_path")
async def test_serving_contexts_rotate_so_the_per_session_clients_do_not_pile_up(tokenizer, tiny_model_dir):
    """verifiers keeps a model client per distinct endpoint for a serving context's life, and each session has its
    own URL: after `episodes_per_serving` episodes a fresh context takes over and the old one is closed."""
    from fleetrl.environments.verifiers import VerifiersRollout

    tasks = list(load_env("reverse_text").taskset)
    answers = [tasks[i].data.answer for i in range(5)]
    setup = scripted_setup(tokenizer, tiny_model_dir, answers)
    rollout = VerifiersRollout(setup, "reverse_text", episodes_per_serving=2)
    try:
        runs = [await rollout({"task_idx": i}) for i in range(5)]
        assert [r.reward for r in runs] == [1.0] * 5
        assert rollout.servings_opened == 3  # 2 + 2 + 1 episodes
        assert rollout.env._interception is None  # the first context was closed once its episodes were done
    finally:
        await rollout.close()
        await setup.sessions.close()
    with pytest.raises(ValueError, match="episodes_per_serving"):
        VerifiersRollout(setup, "reverse_text", episodes_per_serving=0)
