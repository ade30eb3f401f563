"""The arithmetic task: addition `a+b=` (operands 0-49) answered with the digits of the sum and end-of-text.

Rows are `{"prompt": "37+48=", "answer": "85"}`; the reward is 1 for exactly the right digits followed by the
end of text, else 0 (verifiable, no partial credit). The data is generated from a seed, so every machine gets the
same train and held-out rows.
"""

from __future__ import annotations

import random

MAX_OPERAND = 49


def make_rows(n: int, seed: int, exclude: set[str] | None = None) -> list[dict[str, str]]:
    """`n` distinct problems (not in `exclude`), deterministic for a seed."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen = set(exclude or ())
    while len(rows) < n:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        prompt = f"{a}+{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return rows


def split_rows(seed: int = 0, n_eval: int = 200, n_train: int = 2000) -> tuple[list[dict], list[dict]]:
    """Held-out rows first, then training rows that never repeat a held-out problem."""
    held_out = make_rows(n_eval, seed)
    train = make_rows(n_train, seed + 1, exclude={r["prompt"] for r in held_out})
    return train, held_out


def score(completion: str, answer: str, finished: bool) -> float:
    """1.0 when the completion is exactly the answer and generation stopped (end of text), else 0.0."""
    return 1.0 if finished and completion.strip() == answer else 0.0
