"""examples/openenv_echo end to end: an OpenEnv environment server (started by the example on the gateway's
loopback) is played through openenv-core's client and trains through `fleetrl up` on the tiny model; what the trainer
gets is what the replica generated: every trained token and logprob is one the server recorded for the episode's
session (each once, in order), and the trainer's own logprobs of those tokens agree with the sampler's
(optim/kl_sample_train_v1 ~ 0). The summed step rewards are the sample's reward."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.up.conftest import REPO, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_openenv_environment_trains_on_exactly_what_the_server_generated(tiny_model_dir, tmp_path):
    pytest.importorskip("openenv")
    record = tmp_path / "sessions.jsonl"
    sets = {
        "base_model": tiny_model_dir,
        "log_path": str(tmp_path / "run"),
        "max_steps": 2,
        "max_head_offpolicy_versions": 0,
    }
    overrides = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    options = '{ action_field = "message", observation_field = "prompt", max_turns = 2 }'
    extras = f"environment_options = {options}, record_path = {json.dumps(str(record))}"
    overrides += ["--set", f"rollout_extras={{{extras}}}"]
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(REPO / "examples/openenv_echo/run.toml"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = [m for m in read_metrics(tmp_path / "run") if "data/samples" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/openenv_steps"] >= 1.0
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 16
    assert any(len(line["turns"]) == 2 for line in lines)  # a wrong reply got the environment's second try
    for line in lines:
        turns = line["turns"]
        generated = [(t, lp) for u in turns for t, lp in zip(u["completion_token_ids"], u["logprobs"], strict=True)]
        trained = [
            (t, lp)
            for s in line["samples"]
            for t, lp, m in zip(s["tokens"], s["logprobs"], s["loss_mask"], strict=True)
            if m
        ]
        assert trained == generated
        first_prompt = turns[0]["prompt_token_ids"]
        assert line["samples"][0]["tokens"][: len(first_prompt)] == first_prompt
        assert 0.0 <= line["reward"] <= 2.0  # at most one 1.0 step reward after a partial one
