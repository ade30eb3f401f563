"""Message-in, token-out multi-turn trajectories: the cookbook's `MessageTrajectoryAssembler` and `TITOTokenizer`.

A rollout that talks in OpenAI-style messages still has to train on the exact tokens the model saw and produced.
Re-applying the chat template to the whole conversation each turn can give other tokens (BPE merges decoded text
differently from how the model split it; templates such as Qwen3's rewrite history), so here a turn only appends:

    prompt_0     = template(messages_0, add_generation_prompt=True)
    prompt_{i+1} = prompt_i + completion_i + close(completion_i) + delta(messages appended since)

`close` is what of the template's end-of-turn tokens (ChatML: `<|im_end|>\\n`) the model did not write itself, and
`delta` is the template's rendering of the appended (user, tool, system) messages plus the next generation prompt,
cut from a render of a stand-in conversation. Usage, as in the cookbook's multi-turn example:

    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    prompt_tokens = assembler.prepare_next_input(messages)          # each turn
    ... sample from prompt_tokens ...
    assembler.add_assistant_response(request_messages=messages, assistant_message=..., prompt_token_ids=...,
                                     completion_token_ids=..., completion_logprobs=..., finish_reason=...)
    tokens, logprobs, loss_mask = assembler.trajectory.to_flat()   # mask 1 on every generated token

A request that does not extend the stored conversation (an earlier message changed or dropped) raises
`MessageValidationError`: fleetrl does not roll back. Start a new assembler for a rewritten history and return the
pieces as segments of one `RolloutRun`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_MARKER = "\u2063fleetrl-assistant-turn\u2063"  # assistant text unlikely to occur in a template or be merged with
_STAND_IN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]


class MessageTrajectoryError(ValueError):
    """A message-in trajectory that cannot be kept as exact tokens."""


class MessageValidationError(MessageTrajectoryError):
    """The new request does not extend the stored conversation, or appends a message of a refused role."""


class TokenizationError(MessageTrajectoryError):
    """The chat template cannot be rendered one appended message at a time."""


class PrefixMismatch(MessageTrajectoryError):
    """A model call's prompt does not start with the tokens accumulated so far."""


def missing_turn_end(generated: Sequence[int], turn_end: Sequence[int]) -> list[int]:
    """What to append after `generated` to close the assistant turn: the part of `turn_end` the model did not
    write. A reply that stopped on `<|im_end|>` needs only `\\n`; one cut by max_tokens needs all of it."""
    for k in range(min(len(turn_end), len(generated)), 0, -1):
        if list(generated[-k:]) == list(turn_end[:k]):
            return list(turn_end[k:])
    return list(turn_end)


class TITOTokenizer:
    """Token-in/token-out tokenization of a chat: the first prompt rendered whole, later turns as appended tokens.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        chat_template_kwargs: passed to every `apply_chat_template` call (e.g. `enable_thinking`).
        allowed_append_roles: roles a later request may append after the assistant's reply (user, tool, system).
    """

    max_trim_tokens: int = 0  # fleetrl never trims accumulated tokens: the next prompt extends them exactly

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        allowed_append_roles: Sequence[str] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizationError("this tokenizer has no chat template; message-in rollouts need one")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.allowed_append_roles = list(allowed_append_roles or ("user", "tool", "system"))
        self._turn_end: list[int] | None = None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, tools: Any = None) -> str:
        kwargs = {**self.chat_template_kwargs, **({"tools": tools} if tools is not None else {})}
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Template text to ids; the template writes its own special tokens, so none are added here."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def render_initial_prompt(self, messages: Sequence[dict[str, Any]], *, tools: Any = None) -> list[int]:
        """The first prompt: the whole conversation rendered with the generation prompt."""
        return self.encode(self.render(messages, True, tools))

    def turn_end_tokens(self) -> list[int]:
        """The tokens the template writes after an assistant message's content (ChatML: `<|im_end|>`, `\\n`)."""
        if self._turn_end is None:
            text = self.render(_STAND_IN, False)
            self._turn_end = self.encode(text[text.rindex(_MARKER) + len(_MARKER) :])
        return list(self._turn_end)

    def appended_tokens(self, messages: Sequence[dict[str, Any]], *, tools: Any = None) -> list[int]:
        """The template's tokens for `messages` following a closed assistant turn, up to and including the next
        generation prompt: rendered after a stand-in exchange, cut after the assistant's end-of-turn text."""
        closed = self.render(_STAND_IN, False, tools)
        opened = self.render([*_STAND_IN, *messages], True, tools)
        after_closed = closed[closed.rindex(_MARKER) + len(_MARKER) :]
        after_opened = opened[opened.rindex(_MARKER) + len(_MARKER) :]
        if not after_opened.startswith(after_closed):
            raise TokenizationError(
                "the chat template ends an assistant turn differently when another message follows "
                f"({after_closed!r} vs {after_opened[: len(after_closed)]!r}); cannot append turns as tokens"
            )
        return self.encode(after_opened[len(after_closed) :])

    def merge_tokens(
        self,
        *,
        old_messages: Sequence[dict[str, Any]],
        new_messages: Sequence[dict[str, Any]],
        pretokenized_token_ids: Sequence[int],
        tools: Any = None,
    ) -> list[int]:
        """The next prompt: `pretokenized_token_ids` (the conversation so far, ending with the model's reply to
        `old_messages[-1]`), the rest of that reply's turn end, and the messages `new_messages` appends."""
        check_append_only(old_messages, new_messages, self.allowed_append_roles)
        appended = list(new_messages[len(old_messages) :])
        close = missing_turn_end(pretokenized_token_ids, self.turn_end_tokens())
        return [*pretokenized_token_ids, *close, *self.appended_tokens(appended, tools=tools)]


def check_append_only(
    old_messages: Sequence[dict[str, Any]], new_messages: Sequence[dict[str, Any]], allowed_roles: Sequence[str]
) -> None:
    """`new_messages` must start with `old_messages` unchanged and append only messages of `allowed_roles`."""
    if len(new_messages) < len(old_messages):
        raise MessageValidationError(
            f"the request has {len(new_messages)} messages, fewer than the {len(old_messages)} already in the "
            "trajectory; start a new MessageTrajectoryAssembler for a rewritten history"
        )
    for i, (old, new) in enumerate(zip(old_messages, new_messages, strict=False)):
        if old != new:
            raise MessageValidationError(
                f"message {i} differs from the one already in the trajectory; the trajectory only appends "
                "(start a new MessageTrajectoryAssembler for a rewritten history)"
            )
    for i, message in enumerate(new_messages[len(old_messages) :], start=len(old_messages)):
        if message.get("role") not in allowed_roles:
            raise MessageValidationError(
                f"message {i} has role {message.get('role')!r}; after the assistant's reply a request may append "
                f"only {list(allowed_roles)}"
            )


@dataclass
class InferenceCall:
    """One model call: the whole prompt it was given, the tokens it generated and their sampler logprobs."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    finish_reason: str = "stop"


@dataclass
class TrajectoryAssembler:
    """Model calls folded into one token sequence; each call's prompt must extend what came before."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: list[InferenceCall] = field(default_factory=list)

    def add_call(self, call: InferenceCall, *, max_trim_tokens: int = 0) -> None:
        """Append the call's new prompt tokens (mask 0, logprob 0.0) and its generated tokens (mask 1)."""
        if max_trim_tokens:
            raise ValueError("fleetrl's TrajectoryAssembler does not trim: max_trim_tokens must be 0")
        if len(call.output_logprobs) != len(call.output_tokens):
            raise ValueError(f"{len(call.output_tokens)} generated tokens but {len(call.output_logprobs)} logprobs")
        prompt = list(call.input_tokens)
        if prompt[: len(self.tokens)] != self.tokens:
            at = next((i for i, (a, b) in enumerate(zip(self.tokens, prompt, strict=False)) if a != b), len(prompt))
            raise PrefixMismatch(
                f"the call's prompt ({len(prompt)} tokens) does not extend the trajectory ({len(self.tokens)} "
                f"tokens): they differ from token {at}; build the next prompt with prepare_next_input"
            )
        gap = prompt[len(self.tokens) :]
        self.tokens += [*gap, *call.output_tokens]
        self.logprobs += [0.0] * len(gap) + [float(x) for x in call.output_logprobs]
        self.loss_mask += [0] * len(gap) + [1] * len(call.output_tokens)
        self.calls.append(call)

    @property
    def accumulated_tokens(self) -> list[int]:
        return list(self.tokens)

    def to_flat(self) -> tuple[list[int], list[float], list[int]]:
        """(tokens, logprobs, loss_mask): mask 1 on every generated token of every call, logprob 0.0 elsewhere."""
        return list(self.tokens), list(self.logprobs), list(self.loss_mask)


@dataclass
class MessageTrajectoryAssembler:
    """A chat kept as exact tokens: `prepare_next_input(messages)` before each call, `add_assistant_response`
    after it, `trajectory.to_flat()` at the end."""

    tito_tokenizer: TITOTokenizer
    trajectory: TrajectoryAssembler = field(default_factory=TrajectoryAssembler)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.trajectory.accumulated_tokens

    def prepare_next_input(self, request_messages: Sequence[dict[str, Any]], *, tools: Any = None) -> list[int]:
        """The prompt tokens for `request_messages`: rendered whole before the first reply, afterwards the
        accumulated tokens extended by the messages appended since (`MessageValidationError` if it does not
        extend the stored conversation)."""
        if not self.trajectory.calls:
            return self.tito_tokenizer.render_initial_prompt(request_messages, tools=tools)
        return self.tito_tokenizer.merge_tokens(
            old_messages=self.messages,
            new_messages=request_messages,
            pretokenized_token_ids=self.token_ids,
            tools=tools,
        )

    def add_assistant_response(
        self,
        *,
        request_messages: Sequence[dict[str, Any]],
        assistant_message: dict[str, Any],
        prompt_token_ids: Sequence[int],
        completion_token_ids: Sequence[int],
        completion_logprobs: Sequence[float],
        finish_reason: str = "stop",
    ) -> None:
        """Record one call: its prompt (from `prepare_next_input`), generated tokens and logprobs; the stored
        conversation becomes `request_messages + [assistant_message]`."""
        call = InferenceCall(list(prompt_token_ids), list(completion_token_ids), list(completion_logprobs))
        call.finish_reason = finish_reason
        self.trajectory.add_call(call, max_trim_tokens=self.tito_tokenizer.max_trim_tokens)
        self.messages = [*request_messages, assistant_message]
