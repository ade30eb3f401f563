"""Reward of the multi-turn retry task: the answer is the last integer in the assistant's reply.

A correct answer on turn t (1-based) earns `retry_discount ** (t - 1)`: full credit for getting it right at once,
less for each retry the feedback had to prompt; never correct earns 0.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d[\d,]*")


def parse_answer(reply: str) -> int | None:
    """The last integer in `reply` (commas as thousands separators allowed), or None."""
    matches = _INT.findall(reply)
    if not matches:
        return None
    try:
        return int(matches[-1].replace(",", ""))
    except ValueError:
        return None


def is_correct(reply: str, answer: str | int) -> bool:
    parsed = parse_answer(reply)
    return parsed is not None and parsed == int(answer)


def compute_reward(correct: bool, turns_used: int, retry_discount: float = 0.5) -> float:
    """1[correct] * retry_discount ** (turns_used - 1)."""
    if turns_used < 1:
        raise ValueError(f"turns_used must be >= 1, got {turns_used}")
    if not 0.0 <= retry_discount <= 1.0:
        raise ValueError(f"retry_discount must be in [0, 1], got {retry_discount}")
    return retry_discount ** (turns_used - 1) if correct else 0.0


def feedback_message(reply: str) -> dict[str, str]:
    """The user turn sent after a wrong answer."""
    if parse_answer(reply) is None:
        content = "I could not find a number in your answer. Try again and end your reply with the number."
    else:
        content = "That is not correct. Check your work and try again; end your reply with the number."
    return {"role": "user", "content": content}
