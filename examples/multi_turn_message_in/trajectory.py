"""A multi-turn chat trajectory kept as tokens: exactly what the model saw and produced, never re-tokenized.

Re-rendering the whole conversation with the chat template each turn (decode the reply, append it as a message,
apply the template again) can give different tokens than the model produced: BPE merges text differently than the
model split it, and templates rewrite history (Qwen3's drops earlier turns' `<think>` blocks). Training on those
tokens would train on something the policy never generated. Here a turn only ever appends:

    prompt_0 = template(messages, add_generation_prompt=True)
    call i returns prompt_i + generated_i
    prompt_{i+1} = prompt_i + generated_i + close(generated_i) + delta(feedback message)

where `close` is whatever of the template's end-of-turn tokens (ChatML: `<|im_end|>\\n`) the model did not
generate itself, and `delta` is the template's rendering of the new message plus the next generation prompt,
cut from a render of a stand-in conversation. Generated tokens get loss_mask 1 and their sampler logprobs;
everything else gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl import RolloutRun, RolloutSample, RolloutSegment

_MARKER = "\u2063fleetrl-assistant-turn\u2063"  # assistant text unlikely to occur in a template or be merged with


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; multi-turn chat needs one (use an instruct model)")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Template text to ids; the template writes its own BOS/special tokens, so none are added here."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def turn_end_tokens(tokenizer: Any) -> list[int]:
    """The tokens the template writes after an assistant message's content (ChatML: `<|im_end|>`, `\\n`)."""
    text = _render(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}], False)
    return encode(tokenizer, text[text.rindex(_MARKER) + len(_MARKER) :])


def message_delta_tokens(tokenizer: Any, message: dict[str, Any]) -> list[int]:
    """The template's tokens for `message` following an assistant turn, up to and including the next generation
    prompt: rendered after a stand-in user/assistant exchange and cut after the assistant's end-of-turn text."""
    exchange = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]
    closed = _render(tokenizer, exchange, False)
    opened = _render(tokenizer, [*exchange, message], True)
    after_closed = closed[closed.rindex(_MARKER) + len(_MARKER) :]
    after_opened = opened[opened.rindex(_MARKER) + len(_MARKER) :]
    if not after_opened.startswith(after_closed):
        raise ValueError(
            "the chat template ends an assistant turn differently when another message follows "
            f"({after_closed!r} vs {after_opened[: len(after_closed)]!r}); cannot append turns as tokens"
        )
    return encode(tokenizer, after_opened[len(after_closed) :])


def missing_turn_end(generated: Sequence[int], turn_end: Sequence[int]) -> list[int]:
    """What to append after `generated` to close the assistant turn: the part of `turn_end` the model did not
    write. A reply that stopped on `<|im_end|>` needs only `\\n`; one cut by max_tokens needs all of it."""
    for k in range(min(len(turn_end), len(generated)), 0, -1):
        if list(generated[-k:]) == list(turn_end[:k]):
            return list(turn_end[k:])
    return list(turn_end)


@dataclass
class ModelCall:
    """One sampler call: the prompt it was given and the tokens it generated."""

    prompt_tokens: list[int]
    generated_tokens: list[int]


@dataclass
class ChatTrajectory:
    """Tokens, logprobs, loss mask and versions of a conversation, grown one turn at a time."""

    tokenizer: Any
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[ModelCall] = field(default_factory=list)
    version: int = 0  # of the latest generated token; context tokens after it get it (only masked ones count)

    @classmethod
    def start(cls, tokenizer: Any, messages: Sequence[dict[str, Any]]) -> ChatTrajectory:
        traj = cls(tokenizer)
        traj._append_context(encode(tokenizer, _render(tokenizer, messages, True)))
        return traj

    def _append_context(self, tokens: Sequence[int]) -> None:
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.versions += [self.version] * len(tokens)

    def add_completion(self, completion: Any) -> list[int]:
        """Append a sampler completion made from `self.tokens`; returns its generated tokens."""
        if completion.full_tokens[: completion.prompt_len] != self.tokens:
            raise ValueError("the completion was not sampled from this trajectory's tokens")
        generated = list(completion.full_tokens[completion.prompt_len :])
        if len(generated) != len(completion.inference_logprobs):
            raise ValueError(f"{len(generated)} generated tokens but {len(completion.inference_logprobs)} logprobs")
        if not self.calls and completion.versions:
            self.versions = [completion.versions[0]] * len(self.versions)  # the opening prompt: its first version
        self.calls.append(ModelCall(list(self.tokens), generated))
        self.tokens += generated
        self.logprobs += list(completion.inference_logprobs)
        self.loss_mask += [1] * len(generated)
        self.versions += list(completion.versions) if completion.versions else [self.version] * len(generated)
        if self.versions:
            self.version = self.versions[-1]
        return generated

    def add_message(self, message: dict[str, Any]) -> None:
        """Close the assistant turn and append `message` (a user/feedback/tool turn) and the next generation
        prompt, as the template writes them; these tokens are context, never trained (mask 0)."""
        if not self.calls:
            raise ValueError("add_message follows an assistant turn; start the trajectory with all opening messages")
        last = self.calls[-1].generated_tokens
        self._append_context(missing_turn_end(last, turn_end_tokens(self.tokenizer)))
        self._append_context(message_delta_tokens(self.tokenizer, message))

    def to_run(self, reward: float, finish_reason: str, text: str, metrics: dict[str, float]) -> RolloutRun:
        """The conversation as the cookbook's RolloutRun: one segment per model call (its prompt and what it
        generated). Each segment extends the previous one, so fleetrl joins them into one sample (`to_sample`)."""
        segments, end = [], 0
        for call in self.calls:
            end = len(call.prompt_tokens) + len(call.generated_tokens)
            segments.append(
                RolloutSegment(self.tokens[:end], self.logprobs[:end], self.loss_mask[:end], self.versions[:end])
            )
        if end < len(self.tokens):  # context appended after the last call: part of the trajectory, never trained
            segments.append(
                RolloutSegment(list(self.tokens), list(self.logprobs), list(self.loss_mask), list(self.versions))
            )
        return RolloutRun(segments, reward, finish_reason, text, metrics)

    def to_sample(self, reward: float, finish_reason: str, text: str, metrics: dict[str, float]) -> RolloutSample:
        return RolloutSample(
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            loss_mask=list(self.loss_mask),
            reward=reward,
            finish_reason=finish_reason,
            text=text,
            versions=list(self.versions),
            metrics=metrics,
        )
