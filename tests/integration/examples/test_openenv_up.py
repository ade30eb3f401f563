"""examples/openenv_echo end to end: an OpenEnv environment server (started by the example on the gateway's
loopback) is played through openenv-core's client and trains through `fleetrl up` on the tiny model; what the trainer
gets is what the replica generated: every trained token and logprob is one the server recorded for the episode's
session (each once, in order), and the trainer's own logprobs of those tokens agree with the sampler's
(optim/kl_sample_train_v1 ~ 0). The summed step rewards are the sample's reward."""

from __future__ import annotations

import json

import pytest

from tests.integration.examples.own_data_up import assert_trained_what_was_generated, up_own_example

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_openenv_environment_trains_on_exactly_what_the_server_generated(tiny_model_dir, tmp_path):
    pytest.importorskip("openenv")
    record = tmp_path / "sessions.jsonl"
    sets = {
        "base_model": tiny_model_dir,
        "max_steps": 2,
        "max_head_offpolicy_versions": 0,
    }
    options = '{ action_field = "message", observation_field = "prompt", max_turns = 2 }'
    extras = f"environment_options = {options}, record_path = {json.dumps(str(record))}"
    metrics = up_own_example("openenv_echo", tmp_path / "run", sets, extras)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/openenv_steps"] >= 1.0
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 16
    assert any(len(line["turns"]) == 2 for line in lines)  # a wrong reply got the environment's second try
    for line in lines:
        assert_trained_what_was_generated(line)
        assert 0.0 <= line["reward"] <= 2.0  # at most one 1.0 step reward after a partial one
