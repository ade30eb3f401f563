"""An OpenEnv (openenv-core 0.3.0) environment server as its authors write one: `echo_word` shows a word and asks
for it back; a wrong reply gets one more try. Nothing in it knows about fleetrl.

    python examples/openenv_echo/server.py --port 8765      # serve it alone (uvicorn)

Each step's reward: 1.0 for the word exactly, else the share of its letters in place (a little signal for an
untrained model); the episode ends on the right word or after `MAX_TRIES` replies.
"""

from __future__ import annotations

import argparse
import random
import uuid
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud", "green", "light", "house", "bread", "chair", "plant", "smile", "water"]
MAX_TRIES = 2


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    prompt: str
    tries_left: int


class EchoWordEnvironment(Environment[EchoAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session gets its own instance; nothing is shared

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.word = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self.word = random.Random(seed).choice(WORDS)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return EchoObservation(prompt=f"Repeat this word exactly: {self.word}", tries_left=MAX_TRIES)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        reply = action.message.strip()
        reward = (
            1.0
            if reply == self.word
            else sum(a == b for a, b in zip(reply, self.word, strict=False)) / (2 * len(self.word))
        )
        tries_left = MAX_TRIES - self._state.step_count
        done = reward == 1.0 or tries_left <= 0
        prompt = "Correct." if reward == 1.0 else f"Not quite. Repeat this word exactly: {self.word}"
        return EchoObservation(prompt=prompt, tries_left=tries_left, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


def make_app(max_sessions: int = 64) -> Any:
    """The FastAPI app serving `EchoWordEnvironment` (one instance per WebSocket session)."""
    return create_app(EchoWordEnvironment, EchoAction, EchoObservation, "echo_word", max_concurrent_envs=max_sessions)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    uvicorn.run(make_app(), host="127.0.0.1", port=parser.parse_args().port)
