import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "arithmetic"))

from arithmetic_task import make_rows, score, split_rows


def test_rows_are_deterministic_and_held_out_never_trains():
    train, held_out = split_rows(seed=0, n_eval=50, n_train=300)
    assert (train, held_out) == split_rows(seed=0, n_eval=50, n_train=300)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train[:20]:
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["answer"]) == int(a) + int(b)
    assert len({r["prompt"] for r in make_rows(100, seed=3)}) == 100


def test_score_needs_the_exact_answer_and_a_stop():
    assert score("46", "46", finished=True) == 1.0
    assert score(" 46 ", "46", finished=True) == 1.0
    assert score("46", "46", finished=False) == 0.0  # ran out of tokens: not an answer
    assert score("64", "46", finished=True) == 0.0
    assert score("461", "46", finished=True) == 0.0
