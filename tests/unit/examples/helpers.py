"""Helpers for the examples' unit tests: import an example's module by path, and a scripted stand-in sampler."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from fleetrl.gateway.sampler import SampledCompletion

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load_example_module(example: str, module: str) -> ModuleType:
    """`examples/<example>/<module>.py`, imported once under a unique name; the example's folder goes on sys.path
    first, as the gateway's loader does, so the module's imports of its neighbours (reward.py, ...) resolve."""
    name = f"fleetrl_example_{example}_{module}"
    if name in sys.modules:
        return sys.modules[name]
    path = EXAMPLES / example / f"{module}.py"
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class ScriptedSampler:
    """Stands in for the gateway's sampler: each call "generates" the next scripted token list (or what
    `reply(prompt_tokens)` returns) and records the prompt it was given. Logprobs are distinct per call and
    position so tests can check where each one lands."""

    def __init__(
        self,
        tokenizer: Any,
        replies: Sequence[list[int]] | Callable[[list[int]], list[int]],
        *,
        version: int = 3,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.replies = replies
        self.version = version
        self.stop_token_ids = set(stop_token_ids) | {tokenizer.eos_token_id}
        self.prompts: list[list[int]] = []
        self.generated: list[list[int]] = []
        self.kwargs: list[dict[str, Any]] = []

    async def sample_with_prompt_tokens(self, prompt_tokens: Sequence[int], n: int = 1, **kwargs: Any):
        assert n == 1
        prompt = list(prompt_tokens)
        call = len(self.prompts)
        generated = list(self.replies(prompt) if callable(self.replies) else self.replies[call])
        self.prompts.append(prompt)
        self.generated.append(generated)
        self.kwargs.append(kwargs)
        logprobs = [-(call + 1) - 0.01 * i for i in range(len(generated))]
        finish = "stop" if generated and generated[-1] in self.stop_token_ids else "length"
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        versions = [self.version] * len(generated)
        return [SampledCompletion(prompt + generated, len(prompt), logprobs, finish, text, versions)]

    async def sample_with_tokens(self, messages: Sequence[dict[str, Any]], n: int = 1, **kwargs: Any):
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return await self.sample_with_prompt_tokens(self.tokenizer.encode(text, add_special_tokens=False), n, **kwargs)


def generated_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
