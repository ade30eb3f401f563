"""examples/arithmetic/warm_start.py shows its progress and its result, trained by `fleetrl sft` (the default) or by
its own loop (`--loop script`), and both loops see the same supervised draws."""

from __future__ import annotations

import json
import random

import pytest

from tests.unit.examples.helpers import load_example_module


@pytest.mark.slow  # the held-out greedy answers take a few seconds
def test_warm_start_shows_progress_and_its_result(tmp_path, capsys):
    warm_start = load_example_module("arithmetic", "warm_start")
    assert warm_start.main(["--out", str(tmp_path), "--steps", "3", "--batch", "4", "--loop", "script"]) == 0
    out = capsys.readouterr().out
    # Not a terminal here: each bar's final state once, then the summary line.
    assert "supervised warm start" in out and "100%" in out and "loss " in out
    assert "held-out greedy answers" in out
    assert "warm start: 3 steps, final loss" in out
    assert (tmp_path / "model" / "config.json").exists()


@pytest.mark.slow  # a trainer, three steps and the held-out answers
def test_warm_start_trains_through_fleetrl_sft(tmp_path, capsys):
    warm_start = load_example_module("arithmetic", "warm_start")
    assert warm_start.main(["--out", str(tmp_path), "--steps", "3", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "fleetrl sft: 3 steps on 12 rows (dropped: none)" in out
    assert "warm start: 3 steps, final loss" in out and "held-out greedy accuracy" in out
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "train/loss" in r]) == 3
    assert (tmp_path / "model" / "model.safetensors").exists()


def test_the_sft_rows_are_the_loops_draws_in_order():
    warm_start = load_example_module("arithmetic", "warm_start")
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10)]
    drawn = warm_start.sft_rows(rows, steps=2, batch=3, seed=5, noise=0.5)
    rng = random.Random(5)  # the script loop's order: a batch's picks, then each pick's (noisy) answer
    expected = []
    for _ in range(2):
        picked = [rng.choice(rows) for _ in range(3)]
        expected += [{"prompt": r["prompt"], "completion": warm_start.noisy_answer(r, rng, 0.5)} for r in picked]
    assert drawn == expected and len(drawn) == 6
