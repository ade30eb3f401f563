"""Agent sessions: train an agent written against the OpenAI SDK as it is.

A rollout opens a session, hands its OpenAI base URL, key and model name to an unmodified agent loop (the official
`openai` client: chat completions, multi-turn, tool calls, streaming or not), and turns what the agent did into a
trainable result with one call:

    session = await setup.open_session()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
    answer = await my_agent(client, model=session.model, task=row["prompt"])    # the agent's own code
    return session.to_rollout_run(reward=score(answer))                        # or to_rollout_sample(...)

fleetrl serves the session (fleetrl.gateway.session_server) and records every model call there: the exact prompt
token ids the chat template gave, the completion token ids the model generated, their sampler logprobs and the
policy version of each token; nothing the model produced is re-tokenised. The agent sends messages, so each later
call's prompt is the chat template's rendering of the whole history: where that rendering starts with the previous
call's prompt and completion (the template reproduces what the model wrote), the turns join into one sample; where
it does not (the template re-renders the model's reply or tool calls differently, or the agent rewrote its
history), the trajectory splits into segments as `RolloutRun` does, and the split is counted in the sample metric
`session_splits` (`env/all/session_splits` per step; `session_turns` counts the calls).

With `open_session(exact_history=True)` a call whose messages extend the previous call's (its messages, the reply
the server returned, then only user, tool or system messages) is not re-rendered: its prompt is the previous prompt,
the model's own completion, what the template closes a turn with, and the template's rendering of the appended
messages (the cookbook's token-in/token-out assembly, fleetrl.message_trajectory), so the model sees exactly the
tokens it generated and the turns join into one sample. A call that does not extend it (an edited history, other
tools) is rendered whole, as without the option.

This module is pure logic (no sockets): the turns a session records, how they become segments, and the appended
prompt of an exact-history session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.message_trajectory import TITOTokenizer, TokenizationError, missing_turn_end
from fleetrl.openai_chat import template_messages
from fleetrl.rollout import RolloutRun, RolloutSample, RolloutSegment

TURNS_METRIC = "session_turns"
SPLITS_METRIC = "session_splits"


class SessionError(ValueError):
    """A session that cannot become the requested trainable result."""


@dataclass(frozen=True)
class SessionTurn:
    """One model call of a session, as the server ran it.

    Attributes:
        prompt_token_ids: the whole prompt the model was given (the chat template's rendering of the messages).
        completion_token_ids: the tokens the model generated, verbatim (a stop token included).
        logprobs: the sampler logprob of each generated token.
        versions: the policy version that generated each token.
        finish_reason: why generation ended ("stop", "length", "tool_calls").
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        n = len(self.completion_token_ids)
        if len(self.logprobs) != n:
            raise SessionError(f"logprobs: {len(self.logprobs)} for {n} completion tokens")
        if len(self.versions) != n:
            raise SessionError(f"versions: {len(self.versions)} for {n} completion tokens")

    def segment(self, prompt_version: int | None = None) -> RolloutSegment:
        """The call as one segment: the prompt (mask 0, logprob 0.0) then the generated tokens (mask 1). Prompt
        tokens carry `prompt_version`, by default the version of the first generated token."""
        prompt, completion = list(self.prompt_token_ids), list(self.completion_token_ids)
        if prompt_version is None:
            prompt_version = self.versions[0] if self.versions else 0
        return RolloutSegment(
            tokens=prompt + completion,
            logprobs=[0.0] * len(prompt) + [float(x) for x in self.logprobs],
            loss_mask=[0] * len(prompt) + [1] * len(completion),
            versions=[prompt_version] * len(prompt) + [int(v) for v in self.versions],
        )


def count_splits(turns: Sequence[SessionTurn]) -> int:
    """How many calls start a new segment because their prompt does not extend everything before it (the join rule
    of `RolloutRun.to_samples`: a segment joins the last one when its tokens start with all of the last's)."""
    splits, gathered = 0, None
    for turn in turns:
        tokens = [*turn.prompt_token_ids, *turn.completion_token_ids]
        if gathered is not None and not (len(tokens) > len(gathered) and tokens[: len(gathered)] == gathered):
            splits += 1
        gathered = tokens
    return splits


def session_segments(turns: Sequence[SessionTurn]) -> list[RolloutSegment]:
    """One segment per call, in order; prompt tokens of a later call carry the version of the call before it."""
    segments, last_version = [], None
    for turn in turns:
        segments.append(turn.segment(last_version))
        if turn.versions:
            last_version = turn.versions[-1]
    return segments


def comparable_message(message: dict[str, Any]) -> dict[str, Any]:
    """What of a message (in `template_messages` form) the chat template renders: role, text, name, and each tool
    call's function name and arguments; ids and fields the client adds (refusal, annotations) are left out."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
    if message.get("name"):
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")) for c in calls
        ]
    return out


@dataclass(frozen=True)
class ExactHistory:
    """Where an exact-history session's last call left the conversation: its messages and the reply (as
    `comparable_message`s), the tokens (prompt + completion) and the tools offered."""

    messages: list[dict[str, Any]]
    tokens: list[int]
    tools: Any = None


def appended_prompt(
    tito: TITOTokenizer, history: ExactHistory | None, messages: Sequence[Any], tools: Any = None
) -> list[int] | None:
    """The next prompt as tokens appended to `history` when `messages` extend it with user, tool or system messages
    only (and the same tools); None when they do not (render the messages whole)."""
    if history is None or tools != history.tools:
        return None
    rendered = template_messages(messages)
    n = len(history.messages)
    if len(rendered) <= n or [comparable_message(m) for m in rendered[:n]] != history.messages:
        return None
    appended = rendered[n:]
    if any(m.get("role") not in tito.allowed_append_roles for m in appended):
        return None
    try:
        delta = tito.appended_tokens(appended, tools=tools)
    except TokenizationError:
        return None
    return [*history.tokens, *missing_turn_end(history.tokens, tito.turn_end_tokens()), *delta]


@dataclass
class AgentSession:
    """One sample's OpenAI endpoint and what was called there (see the module docstring).

    Attributes:
        session_id: the session's key (also its replica affinity: its calls keep to one replica while it is
            routable, moving only when that replica is fenced or fails the call).
        base_url: the OpenAI base URL of the session (`.../sessions/<id>/v1`).
        api_key: the bearer token the endpoint requires.
        model: the model name to pass (the run's served model).
        tokenizer_id: the run's tokenizer (a path or hub id), for an agent that counts tokens itself.
        turns: the recorded calls, in the order they finished.
        exact_history: append a call that extends the previous one as tokens instead of re-rendering it.
        history: where the last call left the conversation (exact-history sessions).
    """

    session_id: str
    base_url: str
    api_key: str
    model: str
    tokenizer_id: str = ""
    turns: list[SessionTurn] = field(default_factory=list)
    closed: bool = False
    exact_history: bool = False
    history: ExactHistory | None = None
    context: Any = None  # the rollout's contextvars (its sampling seeds), which the session's calls run in

    def record(self, turn: SessionTurn) -> None:
        """Keep one finished call; refused once the session was turned into a result."""
        if self.closed:
            raise SessionError(f"session {self.session_id} is closed: it was already turned into a rollout result")
        self.turns.append(turn)

    def metrics(self) -> dict[str, float]:
        """The session's sample metrics: calls made and calls that split the trajectory."""
        return {TURNS_METRIC: float(len(self.turns)), SPLITS_METRIC: float(count_splits(self.turns))}

    def _checked_turns(self) -> list[SessionTurn]:
        turns = [t for t in self.turns if t.completion_token_ids]
        if not turns:
            raise SessionError(
                f"session {self.session_id} recorded no model call that generated tokens: did the agent use "
                "session.base_url?"
            )
        return turns

    def to_rollout_run(
        self,
        reward: float,
        *,
        metrics: dict[str, float] | None = None,
        text: str = "",
        finish_reason: str | None = None,
    ) -> RolloutRun:
        """The session as one trajectory: a segment per call, joined where a call's prompt extends what came
        before and split where it does not (`session_splits`); the loss mask is 1 on the model's tokens only.
        Closes the session (later calls to its endpoint are refused)."""
        turns = self._checked_turns()
        self.closed = True
        run_metrics = {**self.metrics(), **(metrics or {})}
        return RolloutRun(
            segments=session_segments(turns),
            reward=float(reward),
            finish_reason=finish_reason or turns[-1].finish_reason,
            text=text,
            metrics=run_metrics,
            run_id=self.session_id,
        )

    def to_rollout_sample(
        self,
        reward: float,
        *,
        metrics: dict[str, float] | None = None,
        text: str = "",
        finish_reason: str | None = None,
    ) -> RolloutSample:
        """The session as one `RolloutSample`; raises `SessionError` when its calls do not join into one sequence
        (the chat template re-rendered history): use `to_rollout_run` for those."""
        samples = self.to_rollout_run(reward, metrics=metrics, text=text, finish_reason=finish_reason).to_samples()
        if len(samples) != 1:
            raise SessionError(
                f"session {self.session_id} splits into {len(samples)} segments (the chat template re-rendered the "
                "history differently from what the model generated); return session.to_rollout_run(...) instead"
            )
        return samples[0]
