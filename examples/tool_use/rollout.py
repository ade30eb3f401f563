"""Agentic rollout with a slow tool: the model writes an expression, a calculator evaluates it (after an `await`
with latency, like a remote tool), the value is appended, and the model writes the final answer.

Rows: {"question": "What is 37 * 12 + 5?", "answer": "449"}. The transcript is plain text, so any causal LM works:

    <instructions>
    Question: What is 37 * 12 + 5?
    Calculator: 37*12+5          <- model turn (cut after its first line)
    Value: 449                   <- tool result (context, loss_mask 0)
    Answer: 449                  <- model turn

Each tool result is appended as tokens after the model's own tokens; nothing the model produced is re-tokenized.
Reward: 1 when the first integer of the final turn equals the answer. While one rollout awaits its tool, the
gateway runs others and (with max_head_offpolicy_versions >= 1) the trainer trains: that is why async matters.

rollout_extras: tool_latency_s (default 0.5), tool_calls (calculator turns before the answer, default 1).
"""

from __future__ import annotations

import re
from typing import Any

from calculator import calculator

from fleetrl import RolloutSample, RolloutSetup
from fleetrl.rollout import RolloutFn

INSTRUCTIONS = (
    "Use the calculator: write an arithmetic expression on the line after 'Calculator:' and its value comes back.\n"
    "Then write the final answer as a number after 'Answer:'.\n"
)
_INT = re.compile(r"-?\d+")


def first_line_length(tokenizer: Any, tokens: list[int]) -> int:
    """How many tokens cover the first non-empty line, up to the token holding its newline (all if none does)."""
    for i in range(len(tokens)):
        if "\n" in tokenizer.decode(tokens[: i + 1]).lstrip():  # lstrip: a leading newline ends nothing
            return i + 1
    return len(tokens)


def score(answer_text: str, answer: str) -> float:
    match = _INT.search(answer_text)
    return float(match is not None and int(match.group()) == int(answer))


class Transcript:
    """Tokens, logprobs, loss mask and versions of the rollout so far; the model's tokens are kept verbatim."""

    def __init__(self, tokenizer: Any, prompt: str) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] = []
        self.version = 0
        self._append_context(tokenizer.encode(prompt))  # with the tokenizer's BOS, if it has one

    def append_text(self, text: str) -> None:
        """Context the model did not write (tool results, cues): tokenized on its own, mask 0."""
        self._append_context(self.tokenizer.encode(text, add_special_tokens=False))

    def _append_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [self.version] * len(ids)

    def append_generated(self, completion: Any, keep: int) -> list[int]:
        """The first `keep` generated tokens of a completion sampled from `self.tokens` (a prefix of what the model
        wrote is still exactly what it wrote; its logprobs do not depend on the tokens after it)."""
        if completion.full_tokens[: completion.prompt_len] != self.tokens:
            raise ValueError("the completion was not sampled from this transcript's tokens")
        generated = completion.full_tokens[completion.prompt_len :][:keep]
        if not any(self.loss_mask) and completion.versions:
            self.versions = [completion.versions[0]] * len(self.versions)
        self.tokens += generated
        self.logprobs += completion.inference_logprobs[:keep]
        self.loss_mask += [1] * len(generated)
        self.versions += completion.versions[:keep] if completion.versions else [self.version] * len(generated)
        self.version = self.versions[-1]
        return generated


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    latency_s = float(setup.extras.get("tool_latency_s", 0.5))
    tool_calls = int(setup.extras.get("tool_calls", 1))
    tokenizer = setup.tokenizer
    eos = tokenizer.eos_token_id

    async def rollout_fn(row: dict) -> RolloutSample | None:
        transcript = Transcript(tokenizer, f"{INSTRUCTIONS}Question: {row['question']}\nCalculator:")
        tool_errors = 0
        for call in range(tool_calls):
            (c,) = await setup.sampler.sample_with_prompt_tokens(transcript.tokens, n=1, **setup.sample_kwargs)
            generated = c.completion_tokens
            keep = first_line_length(tokenizer, generated)
            while keep and generated[keep - 1] == eos:
                keep -= 1  # the tool result follows, not an end of text
            line = tokenizer.decode(transcript.append_generated(c, keep), skip_special_tokens=True)
            result = await calculator(line, latency_s)  # the slow tool: other rollouts and training go on meanwhile
            tool_errors += result.startswith("error")
            cue = "Calculator:" if call + 1 < tool_calls else "Answer:"
            transcript.append_text(("" if line.endswith("\n") else "\n") + f"Value: {result}\n{cue}")
        (c,) = await setup.sampler.sample_with_prompt_tokens(transcript.tokens, n=1, **setup.sample_kwargs)
        transcript.append_generated(c, len(c.inference_logprobs))
        reward = score(c.text, row["answer"])
        return RolloutSample(
            tokens=transcript.tokens,
            logprobs=transcript.logprobs,
            loss_mask=transcript.loss_mask,
            reward=reward,
            finish_reason=c.finish_reason,
            text=c.text,
            versions=transcript.versions,
            metrics={"correct": reward, "tool_error_frac": tool_errors / max(tool_calls, 1)},
        )

    return rollout_fn
