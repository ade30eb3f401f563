"""A small Tinker environment, written as for tinker-cookbook: additions answered on one line, a retry after a wrong
answer, and a group reward that compares the group's answers.

Only the imports differ from tinker-cookbook code (`tinker_cookbook.rl.types` / `tinker.ModelInput` there); with
tinker-cookbook installed the same classes import from it unchanged.

- `AdditionEnv`: the observation is the question (a chat prompt when the tokenizer has a template); the stop
  condition is the string "\\n" (the sampler cuts there). A wrong answer gets feedback appended to the
  observation (it extends the last one) and one more try, up to `max_turns`; a correct one on turn t earns
  0.5 ** (t - 1).
- `AdditionGroupBuilder.compute_group_rewards`: a bonus of 0.1 to the shortest final answers of the group (in
  characters), which can only be computed with the whole group in view; `logging_tags` ["addition"] files the
  metrics under env/addition/.
- `AdditionDataset`: an RLDataset of `num_batches` batches of `groups_per_batch` builders, seeded.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

try:  # tinker-cookbook's own classes when it is installed
    from tinker import ModelInput
    from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult
except ImportError:  # the line a port changes: fleetrl's stand-ins, same names and methods
    from fleetrl.tinker import Env, EnvGroupBuilder, ModelInput, RLDataset, StepResult

_INT = re.compile(r"-?\d+")
STOP = ["\n"]


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(f"{text}\nAnswer:")


class AdditionEnv(Env):
    def __init__(self, tokenizer: Any, a: int, b: int, max_turns: int = 2) -> None:
        self.tokenizer, self.answer, self.max_turns = tokenizer, a + b, max_turns
        self.question = f"What is {a} + {b}? Reply with just the number."
        self.tokens: list[int] = []
        self.turn = 0

    async def initial_observation(self) -> tuple[Any, list[str]]:
        self.tokens = encode_prompt(self.tokenizer, self.question)
        return ModelInput.from_ints(self.tokens), STOP

    async def step(self, action: list[int], *, extra: dict | None = None) -> StepResult:
        self.turn += 1
        text = self.tokenizer.decode(action, skip_special_tokens=True)
        match = _INT.search(text)
        correct = match is not None and int(match.group()) == self.answer
        done = correct or self.turn >= self.max_turns
        reward = 0.5 ** (self.turn - 1) if correct else 0.0
        metrics = {"correct": float(correct), "turns": float(self.turn), "answer_chars": float(len(text.strip()))}
        if done:
            return StepResult(reward, True, ModelInput.from_ints([]), STOP, metrics)
        # The retry's observation extends the last one: what the model saw, what it wrote, the feedback.
        feedback = self.tokenizer.encode("\nThat is not right. Try again:", add_special_tokens=False)
        self.tokens = [*self.tokens, *action, *feedback]
        return StepResult(reward, False, ModelInput.from_ints(self.tokens), STOP, metrics)


class AdditionGroupBuilder(EnvGroupBuilder):
    def __init__(self, tokenizer: Any, a: int, b: int, group_size: int, max_turns: int = 2) -> None:
        self.tokenizer, self.a, self.b, self.group_size, self.max_turns = tokenizer, a, b, group_size, max_turns

    async def make_envs(self) -> Sequence[Env]:
        return [AdditionEnv(self.tokenizer, self.a, self.b, self.max_turns) for _ in range(self.group_size)]

    async def compute_group_rewards(self, trajectory_group: list[Any], env_group: Sequence[Env]) -> list[Any]:
        # The last answer's length in characters: only comparable with the whole group in view.
        lengths = [
            len(self.tokenizer.decode(t.transitions[-1].ac.tokens, skip_special_tokens=True).strip())
            for t in trajectory_group
        ]
        shortest = min(lengths, default=0)
        return [(0.1 if n == shortest else 0.0, {"shortest": float(n == shortest)}) for n in lengths]

    def logging_tags(self) -> list[str]:
        return ["addition"]


class AdditionDataset(RLDataset):
    def __init__(self, tokenizer: Any, num_batches: int, groups_per_batch: int, group_size: int, seed: int = 0) -> None:
        self.tokenizer, self.group_size = tokenizer, group_size
        rng = random.Random(seed)
        self.batches = [
            [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(groups_per_batch)] for _ in range(num_batches)
        ]

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [AdditionGroupBuilder(self.tokenizer, a, b, self.group_size) for a, b in self.batches[index]]

    def __len__(self) -> int:
        return len(self.batches)
