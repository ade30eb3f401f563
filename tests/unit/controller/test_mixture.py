"""Dataset mixtures and curricula (issue 44, item 3): rows drawn from several sources by weight (within binomial
tolerance), weights that follow a schedule, a difficulty filter, per-source figures, and a resume that continues
every source exactly where it stopped: a run killed and resumed from its journal leases the same rows as one that
was never interrupted."""

from __future__ import annotations

import math

import pytest

from fleetrl import Config
from fleetrl.config import ConfigError
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.journal import Journal
from fleetrl.controller.mixture import (
    MixtureCursor,
    RowRewards,
    build_mixture,
    pick_source,
    source_rewards,
    weight_at,
)
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.dataset_sources import DatasetSource


def rows(name: str, n: int, **extra) -> list[dict]:
    return [{"prompt": f"{name}-{i}", **{k: v(i) for k, v in extra.items()}} for i in range(n)]


def mixture(specs: list[dict], data: list[list[dict]], seed: int = 0, groups: int = 2, epochs: int = 1):
    sources = [DatasetSource(**spec) for spec in specs]
    return build_mixture(sources, data, epochs=epochs, shuffle=True, seed=seed, groups_per_step=groups)


def draw(cursor: MixtureCursor, count: int) -> list[tuple[int, str]]:
    out = []
    for _ in range(count):
        nxt = cursor.next()
        if nxt is None:
            break
        out.append((nxt[0], nxt[1]["prompt"]))
    return out


def within_binomial(hits: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(hits / n - p) <= z * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_are_drawn_by_weight_within_binomial_tolerance(seed):
    weights = {"a": 1.0, "b": 2.0, "c": 7.0}
    cursor = mixture(
        [{"path": f"{n}.jsonl", "weight": w} for n, w in weights.items()],
        [rows(n, 3000) for n in weights],
        seed=seed,
    )
    drawn = draw(cursor, 2000)
    assert len(drawn) == 2000
    for name, w in weights.items():
        hits = sum(1 for _, prompt in drawn if prompt.startswith(f"{name}-"))
        assert within_binomial(hits, 2000, w / 10.0), (name, hits)
    for row_id, prompt in drawn:  # an id names its source and its row, for requeued rows
        assert cursor.row(row_id)["prompt"] == prompt and prompt.startswith(cursor.source_of(row_id) + "-")
    figures = cursor.figures()
    assert sum(figures[f"data/{n}/rows_drawn"] for n in weights) == 2000


def test_every_row_of_every_source_is_drawn_once_per_epoch_then_the_mixture_ends():
    cursor = mixture([{"path": "a.jsonl", "weight": 5.0}, {"path": "b.jsonl"}], [rows("a", 30), rows("b", 7)], epochs=2)
    drawn = draw(cursor, 1000)
    assert len(drawn) == 74 and cursor.next() is None and cursor.exhausted()
    prompts = sorted(p for _, p in drawn)
    assert prompts == sorted([f"a-{i}" for i in range(30)] * 2 + [f"b-{i}" for i in range(7)] * 2)
    assert len({row_id for row_id, _ in drawn}) == 74  # every occurrence its own id


def test_a_weight_schedule_moves_the_mixture_from_one_source_to_another():
    assert [weight_at(1.0, [(1, 0.0), (11, 1.0)], s) for s in (1, 6, 11, 50)] == [0.0, 0.5, 1.0, 1.0]
    cursor = mixture(
        [
            {"path": "easy.jsonl", "weight_schedule": [[1, 1.0], [10, 1.0], [20, 0.0]]},
            {"path": "hard.jsonl", "weight_schedule": [[1, 0.0], [10, 0.0], [20, 1.0]]},
        ],
        [rows("easy", 500), rows("hard", 500)],
        groups=4,
    )
    drawn = [p for _, p in draw(cursor, 160)]  # steps 1-40 at 4 rows a step
    assert all(p.startswith("easy-") for p in drawn[: 10 * 4])  # steps 1-10: easy only
    assert all(p.startswith("hard-") for p in drawn[19 * 4 :])  # from step 20: hard only
    middle = drawn[10 * 4 : 19 * 4]
    assert any(p.startswith("easy-") for p in middle) and any(p.startswith("hard-") for p in middle)


def test_a_source_whose_weight_is_zero_for_a_while_is_waited_for_not_ended():
    cursor = mixture(
        [
            {"path": "a.jsonl", "weight_schedule": [[1, 1.0], [2, 0.0]]},
            {"path": "b.jsonl", "weight_schedule": [[4, 0.0], [5, 1.0]]},
        ],
        [rows("a", 100), rows("b", 3)],
        groups=1,
    )
    # Step 1: a only; from step 2 a has weight 0 for good, b starts at step 5: steps 2-4 draw nothing, then b.
    drawn = [p for _, p in draw(cursor, 10)]
    assert drawn[0].startswith("a-") and all(p.startswith("b-") for p in drawn[1:]) and len(drawn) == 4
    assert cursor.exhausted()


def test_a_difficulty_filter_draws_only_rows_in_range_and_counts_the_rest():
    data = rows("h", 40, level=lambda i: i % 5)
    data[3] = {"prompt": "h-3"}  # no difficulty: skipped, never a crash
    cursor = mixture(
        [{"path": "h.jsonl", "difficulty_field": "level", "min_difficulty": 3, "max_difficulty": 4}], [data]
    )
    drawn = draw(cursor, 100)
    levels = {int(p.split("-")[1]) % 5 for _, p in drawn}
    assert levels == {3, 4} and "h-3" not in {p for _, p in drawn}
    figures = cursor.figures()
    assert figures["data/h/rows_drawn"] == len(drawn) == 15 and figures["data/h/rows_skipped"] == 25


def test_pick_source_splits_the_unit_interval_by_weight():
    assert [pick_source([1.0, 0.0, 3.0], u) for u in (0.0, 0.24, 0.25, 0.99, 0.999999999)] == [0, 0, 2, 2, 2]


def test_a_restored_cursor_continues_every_source_exactly():
    specs = [{"path": "a.jsonl", "weight": 2.0}, {"path": "b.jsonl", "difficulty_field": "k", "min_difficulty": 1}]
    data = [rows("a", 50), rows("b", 50, k=lambda i: i % 2)]
    full = mixture(specs, data, seed=7)
    uninterrupted = draw(full, 80)
    first = mixture(specs, data, seed=7)
    head = draw(first, 33)
    state = first.journal_state()
    again = mixture(specs, data, seed=7)
    again.restore(state)
    assert head + draw(again, 47) == uninterrupted
    assert again.figures() == full.figures()  # rows drawn and skipped per source carry over too
    with pytest.raises(ValueError, match="one dataset"):
        mixture(specs, data).restore([0, 3])
    with pytest.raises(ValueError, match="dataset mixture"):
        DatasetCursor(rows("x", 3)).restore(state)


def scheduler_over(journal: Journal, cursor: MixtureCursor) -> RowScheduler:
    return RowScheduler(cursor, OffPolicyGate(2, 2, 0), prompt_groups_per_step=2, journal=journal)


def train_steps(s: RowScheduler, steps: int, leased: list[int]) -> None:
    for _ in range(steps):
        for lease in s.lease("gw", 2, now=0.0):
            leased.append(lease.row_id)
            s.report(lease.row_id, "accepted", now=0.0, min_version=s.gate.version, attempt=lease.attempt)
        step = s.take_step()
        s.step_trained(step)
        s.publish(step.step)


def test_a_killed_and_resumed_controller_leases_the_same_rows_per_source_as_an_uninterrupted_one(tmp_path):
    specs = [{"path": "easy.jsonl", "weight": 3.0}, {"path": "hard.jsonl", "weight_schedule": [[1, 0.5], [6, 2.0]]}]
    data = [rows("easy", 40), rows("hard", 40)]

    uninterrupted: list[int] = []
    train_steps(scheduler_over(Journal(tmp_path / "a.sqlite"), mixture(specs, data, seed=3)), 10, uninterrupted)

    leased: list[int] = []
    journal = Journal(tmp_path / "b.sqlite")
    train_steps(scheduler_over(journal, mixture(specs, data, seed=3)), 4, leased)
    journal.close()  # the controller is gone; its journal is all that is left
    journal = Journal(tmp_path / "b.sqlite")
    gate_at = lambda version: OffPolicyGate(2, 2, 0, version=version)  # noqa: E731
    resumed = RowScheduler.resume(
        journal, data[0], gate_at, {}, cursor=mixture(specs, data, seed=3), prompt_groups_per_step=2
    )
    assert resumed.trained_steps == 4 and not resumed.queue
    train_steps(resumed, 6, leased)
    assert leased == uninterrupted  # row for row, from each source
    names = [resumed.cursor.source_of(r) for r in leased]
    assert names.count("easy") and names.count("hard")
    assert resumed.cursor.figures()["data/easy/rows_drawn"] == names.count("easy")


def test_per_source_rewards_of_a_step():
    source_of = {10: "a", 11: "b", 12: "a"}.__getitem__
    figures = source_rewards([10, 11, 12], {10: [1.0, 0.0], 12: [1.0, 1.0], 11: []}, source_of)
    assert figures == {"data/a/groups": 2.0, "data/a/reward_mean": 0.75, "data/b/groups": 1.0}
    store = RowRewards()
    store.record(10, [1.0, float("nan"), 0.0])
    store.record(12, [1.0, 1.0])
    assert store.take_step([10, 12], source_of)["data/a/reward_mean"] == 0.75 and len(store) == 0


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"dataset": "x.jsonl", "datasets": [{"path": "y.jsonl"}]}, "name one dataset or a mixture"),
        ({"datasets": [{"path": "a/x.jsonl"}, {"path": "b/x.jsonl"}]}, "the source names ['x'] repeat"),
        ({"datasets": []}, "name at least one source"),
        ({"datasets": [{"path": "x.jsonl", "weight": 0}]}, "weight"),
        ({"datasets": [{"path": "x.jsonl", "weight_schedule": [[5, 1.0], [2, 1.0]]}]}, "increasing"),
        ({"datasets": [{"path": "x.jsonl", "min_difficulty": 2}]}, "name the rows' difficulty_field"),
        ({"datasets": [{"path": "x.jsonl", "difficulty_field": "d"}]}, "give min_difficulty"),
        ({"datasets": [{"path": "x.jsonl", "name": "a b"}]}, "letters, digits"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_field(run, message):
    with pytest.raises(ConfigError, match=r"datasets|dataset") as info:
        Config.load(run, source="run.toml")
    assert message in str(info.value)
