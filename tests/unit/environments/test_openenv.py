"""fleetrl.environments.openenv: an OpenEnv (openenv-core 0.3.0) environment server (the openenv_echo example's,
served for real on the loopback) played through openenv-core's client with the policy behind a real agent session
server (a scripted sampler behind it): observations become user turns, replies become actions, the step rewards sum
to the sample's reward, and what the rollout returns is exactly what the server generated; an unreachable server, an
unparseable action and bad options fail naming what is wrong."""

from __future__ import annotations

import json
import sys

import pytest
from transformers import AutoTokenizer

from fleetrl.environments import EnvironmentEpisodeError, environment_rollout, environment_rows
from tests.unit.environments.scripted import scripted_setup, trained_and_generated

pytest.importorskip("openenv")
from tests.integration.up.conftest import REPO

EXAMPLE = REPO / "examples" / "openenv_echo"
OPTIONS = {"action_field": "message", "observation_field": "prompt", "max_turns": 2}


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def echo_server():
    """The example's server on a free loopback port (its rollout.py's own starter) and its module."""
    # Other examples' tests import their own `rollout` (and `server`) modules in this worker: set theirs aside so
    # these names resolve to this example's files, and put them back after.
    shadowed = {name: sys.modules.pop(name) for name in ("rollout", "server") if name in sys.modules}
    sys.path.insert(0, str(EXAMPLE))
    try:
        import rollout  # examples/openenv_echo/rollout.py
        import server

        yield rollout.start_server(), server
    finally:
        sys.path.remove(str(EXAMPLE))
        for name in ("rollout", "server"):
            sys.modules.pop(name, None)
        sys.modules.update(shadowed)


async def play(setup, url: str, rows: list[dict], options: dict | None = None) -> list:
    rollout = environment_rollout(f"openenv:{url}", options)(setup)
    try:
        return [await rollout(row) for row in rows]
    finally:
        await setup.sessions.close()


@pytest.mark.parametrize("first_reply_right", [False, True])
async def test_an_episode_trains_exactly_what_the_session_generated_with_the_summed_step_rewards(
    tokenizer, tiny_model_dir, tmp_path, echo_server, first_reply_right
):
    url, server = echo_server
    word = __import__("random").Random(5).choice(server.WORDS)  # what reset(seed=5) picks
    replies = [word] if first_reply_right else ["zzzzz", word]
    record = tmp_path / "record.jsonl"
    setup = scripted_setup(tokenizer, tiny_model_dir, replies, record_path=str(record))
    (run,) = await play(setup, url, [{"reset": {"seed": 5}}], OPTIONS)
    assert run.reward == 1.0  # 0.0 for "zzzzz" (no letter in place), then 1.0 for the word
    assert run.metrics["openenv_steps"] == (1.0 if first_reply_right else 2.0)
    assert run.metrics["openenv_done"] == 1.0
    assert run.turn_rewards == ([1.0] if first_reply_right else [0.0, 1.0])  # each step's reward is its turn's
    assert [r for s in run.to_samples() for r in s.turn_rewards] == run.turn_rewards
    prompts = [tokenizer.decode(p) for p in setup.sessions.sampler.prompts]
    assert f"Repeat this word exactly: {word}" in prompts[0]
    if not first_reply_right:
        assert "Not quite." in prompts[1]
    (line,) = [json.loads(x) for x in record.read_text().splitlines()]
    trained, generated = trained_and_generated(
        [type("T", (), u) for u in line["turns"]], [type("S", (), s) for s in line["samples"]]
    )
    assert trained == generated and len(generated) > 0
    assert trained_and_generated([], run.to_samples())[0] == trained


async def test_an_episode_cut_at_max_turns_keeps_its_partial_rewards(tokenizer, tiny_model_dir, echo_server):
    url, server = echo_server
    word = __import__("random").Random(0).choice(server.WORDS)
    setup = scripted_setup(tokenizer, tiny_model_dir, [word[:2] + "zzz"])
    (run,) = await play(setup, url, [{"reset": {"seed": 0}}], {**OPTIONS, "max_turns": 1})
    assert run.reward == pytest.approx(2 / (2 * len(word)))
    assert run.metrics["openenv_done"] == 0.0


async def test_failures_raise_naming_what_went_wrong(tokenizer, tiny_model_dir, echo_server, unused_tcp_port):
    url, _ = echo_server
    setup = scripted_setup(tokenizer, tiny_model_dir, ["not json", "x"])
    rollout = environment_rollout(f"openenv:{url}", {**OPTIONS, "action_json": True})(setup)
    try:
        with pytest.raises(EnvironmentEpisodeError, match="not a JSON action"):
            await rollout({"reset": {"seed": 1}})
        with pytest.raises(EnvironmentEpisodeError, match="not a JSON action"):
            await rollout({"reset": {"seed": 2}})
        assert rollout.failures.counts == {"bad_action": 2}  # counted by reason
        down = environment_rollout(f"openenv:http://127.0.0.1:{unused_tcp_port}", OPTIONS)(setup)
        with pytest.raises(EnvironmentEpisodeError, match="failed: ConnectionError"):
            await down({"reset": {}})
        with pytest.raises(ValueError, match="reset must be an object"):
            await rollout({"reset": 3})
    finally:
        await setup.sessions.close()
    with pytest.raises(ValueError, match=r"unknown option.*'actionfield'"):
        environment_rollout(f"openenv:{url}", {"actionfield": "x"})(setup)
    with pytest.raises(ValueError, match="needs an http"):
        environment_rollout("openenv:localhost:80", {})(setup)


def test_rows_are_resets_with_seeds_and_the_shipped_rows_match():
    assert environment_rows("openenv:http://127.0.0.1:1", {"num_rows": 3}) == [{"reset": {"seed": i}} for i in range(3)]
    shipped = [json.loads(x) for x in (EXAMPLE / "rows.jsonl").read_text().splitlines()]
    assert shipped == environment_rows("openenv:http://127.0.0.1:1", {"num_rows": 32})
    with pytest.raises(ValueError, match="num_rows"):
        environment_rows("openenv:http://127.0.0.1:1", {"num_rows": 0})
