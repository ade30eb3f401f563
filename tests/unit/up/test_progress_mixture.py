"""`fleetrl up`'s progress over a dataset mixture (issue 44, item 3): without max_steps the planned steps are what
the sources give together (before: none, so no total and no ETA)."""

from __future__ import annotations

from fleetrl import Config
from fleetrl.up.progress import planned_steps


def test_a_mixtures_planned_steps_sum_its_sources(tmp_path):
    for name, n in (("a", 10), ("b", 7)):
        (tmp_path / f"{name}.jsonl").write_text("".join('{"prompt": "x"}\n' for _ in range(n)))
    sources = [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl"), "weight": 2.0}]
    run = Config(datasets=sources, prompt_groups_per_step=2, epochs=2)
    assert planned_steps(run) == (10 + 7) * 2 // 2
    assert planned_steps(Config(datasets=sources, prompt_groups_per_step=2, max_rows=5)) == 5
    missing = [*sources, {"path": str(tmp_path / "none.jsonl")}]
    assert planned_steps(Config(datasets=missing)) is None
