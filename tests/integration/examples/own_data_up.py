"""`fleetrl up` of an example's run.toml on its own dataset, and the exact-capture check of the agent-session
examples: the shared set-up of the end-to-end tests of openai_agent, verifiers_reverse, openenv_echo, code_task and
two_turn (arithmetic_up.py is the one for examples run on arithmetic rows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.up.conftest import REPO, read_metrics


def up_own_example(example: str, log_path: Path, sets: dict[str, Any], rollout_extras: str = "") -> list[dict]:
    """Run `examples/<example>/run.toml` with `sets` as `--set` overrides and `rollout_extras` (a TOML inline
    table's body) as its rollout_extras; fails unless it exits 0. Returns the step lines of metrics.jsonl."""
    overrides = [a for k, v in {**sets, "log_path": str(log_path)}.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    if rollout_extras:
        overrides += ["--set", f"rollout_extras={{{rollout_extras}}}"]
    result = subprocess.run(
        [sys.executable, "-m", "fleetrl", "up", str(REPO / "examples" / example / "run.toml"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    return [m for m in read_metrics(log_path) if "data/samples" in m]


def assert_trained_what_was_generated(line: dict) -> None:
    """One line of a session example's record_path: every trained token and logprob is one the server generated for
    the session (each once, in order), and the first sample starts with the first call's prompt."""
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
