"""examples/verifiers_reverse end to end: a verifiers environment (its own tasks, rubric and multi-turn logic) trains
through `fleetrl up` on the tiny model, and what the trainer gets is what the replica generated: every trained token
and logprob is one the server recorded for the episode's session (each once, in order), and the trainer's own
logprobs of those tokens agree with the sampler's (optim/kl_sample_train_v1 ~ 0: strictly on-policy, so a token
re-tokenised or shifted by one would show as a large KL). The rubric's reward is the sample's."""

from __future__ import annotations

import json

import pytest

from tests.integration.examples.own_data_up import assert_trained_what_was_generated, up_own_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_verifiers_environment_trains_on_exactly_what_the_server_generated(tiny_model_dir, tmp_path):
    pytest.importorskip("verifiers")
    record = tmp_path / "sessions.jsonl"
    sets = {
        "base_model": tiny_model_dir,
        "max_steps": 2,
        "max_head_offpolicy_versions": 0,
    }
    extras = f'environment = "verifiers:reverse_text", record_path = {json.dumps(str(record))}'
    metrics = up_own_example("verifiers_reverse", tmp_path / "run", sets, extras)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/session_turns"] >= 1.0
        assert "env/all/vf_reversed_words" in m  # the rubric's reward, reported per step
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 16
    assert any(len(line["turns"]) == 2 for line in lines)  # the env's correction turn after a wrong answer
    for line in lines:
        assert_trained_what_was_generated(line)
        assert 0.0 <= line["reward"] <= 1.0
