"""Test doubles of the inference engine and tokenizer: no model, no torch."""

from __future__ import annotations

from typing import Any

from fleetrl.clients.inference_types import Completion, EngineError, LoadResult, SamplingRequest
from fleetrl.services.inference.engine import InferenceEngine

END_OF_TURN_ID = 1  # "<|im_end|>"


class CharTokenizer:
    """One token per character (id = code point); id 1 is the special end-of-turn token."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == END_OF_TURN_ID))

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return END_OF_TURN_ID if token == "<|im_end|>" else None

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        return self.encode("".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:")


class ScriptedEngine(InferenceEngine):
    """Answers every request with `reply` (as character tokens), n times; records the requests it got."""

    engine_name = "fake"

    def __init__(self, reply: str = "hello world", *, max_len: int | None = None, fail: bool = False) -> None:
        self.model_path = "/models/fake"
        self.reply = reply
        self.requests: list[SamplingRequest] = []
        self.fail = fail
        self._max_len = max_len

    async def start(self) -> None:
        pass

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        request.validate()
        if self.fail:
            raise EngineError("engine down")
        self.requests.append(request)
        ids = [ord(ch) for ch in self.reply][: request.max_tokens]
        n = len(ids)
        return [
            Completion(list(ids), [-0.5] * n, "length", len(request.prompt_token_ids), [self.loaded_version] * n)
            for _ in range(request.n)
        ]

    async def load_weights(
        self,
        version: int,
        source: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 300.0,
        group_replicas: int = 0,
    ) -> LoadResult:
        raise EngineError("no weights here")

    def queue_depth(self) -> int:
        return 0

    async def shutdown(self) -> None:
        pass

    @property
    def max_model_len(self) -> int | None:
        return self._max_len
