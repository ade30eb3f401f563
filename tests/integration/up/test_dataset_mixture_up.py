"""A `fleetrl up` run over a dataset mixture (issue 44, item 3), its controller SIGKILLed mid-run and resumed: every
step's line has each source's figures, and the rows trained are exactly the mixture's first draws, from each source,
as an uninterrupted run trains them (the draws depend on the seed and their count only, and the journal keeps every
source's cursor)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from fleetrl.controller.journal import Journal
from fleetrl.controller.mixture import build_mixture
from fleetrl.dataset_sources import DatasetSource
from tests.integration.up.conftest import (
    fleetrl_up,
    read_metrics,
    service_pids,
    start_fleetrl_up,
    wait_for_steps,
    write_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_mixture_run_killed_and_resumed_trains_the_same_rows_from_each_source(tmp_path, tiny_model_dir):
    for name, n in (("easy", 30), ("hard", 30)):
        lines = [json.dumps({"prompt": f"count {i} to {i + 3}:", "src": name}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    sources = [
        {"path": str(tmp_path / "easy.jsonl"), "weight": 3.0},
        {"path": str(tmp_path / "hard.jsonl"), "weight_schedule": [[1, 0.5], [4, 2.0]]},
    ]
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {
            "dataset": None,
            "datasets": sources,
            "max_steps": 6,
            "rollout_extras": {"tool_latency_s": 0.3},
        },
        {"rollout": "tests.integration.up.rollouts:make_slow_rollout_fn"},
    )
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        wait_for_steps(proc, run_dir, 2)
        (controller,) = service_pids(config, "controller")
        os.kill(controller, signal.SIGKILL)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    resumed = fleetrl_up(config, extra=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    metrics = [m for m in read_metrics(run_dir) if not any(k.startswith("eval/") for k in m)]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    for line in metrics:
        if line.get("record/recovered"):
            continue
        assert line.get("data/easy/groups", 0) + line.get("data/hard/groups", 0) == 2, line
        assert "data/easy/rows_drawn" in line and "data/hard/weight" in line
        for name in ("easy", "hard"):  # a source with groups in the step has their mean reward
            assert (f"data/{name}/reward_mean" in line) == (f"data/{name}/groups" in line), line
    ledger = Journal(run_dir / "controller.sqlite").rows()
    trained = {r for r, info in ledger.items() if info["status"] == "trained"}

    cursor = build_mixture(
        [DatasetSource(**s) for s in sources],
        [[json.loads(x) for x in (tmp_path / f"{n}.jsonl").read_text().splitlines()] for n in ("easy", "hard")],
        epochs=1,
        shuffle=True,
        seed=0,
        groups_per_step=2,
    )
    first_draws = [cursor.next()[0] for _ in range(12)]
    assert trained == set(first_draws)  # 6 steps x 2 rows: the mixture's first 12 draws, none twice, none lost
    assert {cursor.source_of(r) for r in trained} == {"easy", "hard"}
