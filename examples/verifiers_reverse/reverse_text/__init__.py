"""A verifiers (0.4.0) environment as a user writes one: `reverse_text` asks for a word list backwards.

Ordinary `verifiers.v1` code, nothing of fleetrl in it: a `Taskset` with its own dataset (generated here, seeded,
so the example downloads nothing), a `Task` whose `@vf.reward` is the rubric, and an `Env` with its own multi-turn
logic (a wrong first answer gets one correction turn). `fleetrl.environments.verifiers` runs it as rollouts: each
episode's model calls go through an agent session, so every trained token is one the server generated.

    fleetrl up examples/verifiers_reverse/run.toml
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf
from verifiers.v1.types import content_text

WORDS = ["red", "blue", "cat", "dog", "sun", "map", "tree", "fish", "bird", "milk", "rain", "star", "cup", "pen"]
SYSTEM_PROMPT = "Reverse the order of the words you are given. Answer with the words only."


class ReverseData(vf.TaskData):
    answer: str
    """The words in reverse order, space-separated."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward
    async def reversed_words(self, task: ReverseData, trace: vf.Trace) -> float:
        """The share of positions holding the right word in the last reply (1.0: exactly reversed)."""
        return word_overlap(last_reply(trace), task.answer)


class ReverseTextConfig(vf.TasksetConfig):
    num_tasks: int = 32
    """How many word lists the taskset makes."""
    seed: int = 0
    """Seed of the word lists."""


class ReverseTextTaskset(vf.Taskset[ReverseTask, ReverseTextConfig]):
    def load(self) -> Iterator[ReverseTask]:
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            words = rng.sample(WORDS, 3)
            data = ReverseData(
                id=f"reverse-{i}",
                prompt=" ".join(words),
                system_prompt=SYSTEM_PROMPT,
                answer=" ".join(reversed(words)),
            )
            yield ReverseTask(data, self.config.task)


class ReverseTextEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    """The policy's seat."""
    max_corrections: int = 1
    """Correction turns after a wrong answer."""


class ReverseTextEnv(vf.Env[ReverseTextEnvConfig]):
    """The multi-turn logic: a wrong answer is told so and asked again, up to `max_corrections` times."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        answer = task.data.answer
        async with agents.solver.interaction(task) as solver:
            reply = await solver.turn()
            for _ in range(self.config.max_corrections):
                if reply.terminated or word_overlap(reply.last_reply, answer) == 1.0:
                    break
                reply = await solver.turn(f"Not quite. Reverse these words: {task.data.prompt}")


def last_reply(trace: vf.Trace) -> str:
    """The text of the trace's last assistant message."""
    messages = trace.branches[-1].messages if trace.branches else []
    replies = [m for m in messages if m.role == "assistant"]
    return content_text(replies[-1].content) if replies else ""


def word_overlap(reply: str, answer: str) -> float:
    got, want = reply.split(), answer.split()
    return sum(a == b for a, b in zip(got, want, strict=False)) / len(want)


__all__ = ["ReverseTextEnv", "ReverseTextTaskset"]
