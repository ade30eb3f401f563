"""examples/arithmetic/warm_start.py shows its progress: the supervised steps and the held-out answers."""

from __future__ import annotations

import pytest

from tests.unit.examples.helpers import load_example_module


@pytest.mark.slow  # the held-out greedy answers take a few seconds
def test_warm_start_shows_progress_and_its_result(tmp_path, capsys):
    warm_start = load_example_module("arithmetic", "warm_start")
    assert warm_start.main(["--out", str(tmp_path), "--steps", "3", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    # Not a terminal here: each bar's final state once, then the summary line.
    assert "supervised warm start" in out and "100%" in out and "loss " in out
    assert "held-out greedy answers" in out
    assert "warm start: 3 steps, final loss" in out
    assert (tmp_path / "model" / "config.json").exists()
