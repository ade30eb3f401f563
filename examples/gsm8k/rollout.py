"""GSM8K rollout: one sampled solution per call, scored against the reference's `#### <answer>`.

Rows (the GSM8K JSONL format): {"question": "...", "answer": "reasoning ... #### 42"}.
Reward (the usual GSM8K RL shaping): 1[answer correct] + 0.1 * (1[format correct] - 1), where the format is correct
when the completion writes its final answer as `#### <number>`; without one, the last number in the completion is
taken as its answer. So: 1.0 correct and formatted, 0.9 correct but unformatted, 0.0 wrong, -0.1 wrong and
unformatted.

The prompt goes through the model's chat template (`sampler.sample_with_tokens(messages=...)`) when the tokenizer
has one, else a plain "Question: ... Answer:" prompt as tokens.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from fleetrl import RolloutSample, RolloutSetup
from fleetrl.rollout import RolloutFn

INSTRUCTION = "Solve the problem step by step. Then write the final answer as a number after '####', like '#### 42'."
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_FORMATTED = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def reference_answer(answer_field: str) -> str:
    """The number after the last '####' of a GSM8K answer field."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer field has no '#### <answer>': {answer_field[-80:]!r}")
    return answer_field.rsplit("####", 1)[1].strip()


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").rstrip("."))
    except InvalidOperation:
        return None


def extract_answer(completion: str) -> tuple[str | None, bool]:
    """(the completion's answer, whether it used the `#### <answer>` format): the last '#### <number>' if any,
    else the last number in the text (format not followed), else (None, False)."""
    formatted = _FORMATTED.findall(completion)
    if formatted:
        return formatted[-1], True
    numbers = _ANY_NUMBER.findall(completion)
    return (numbers[-1], False) if numbers else (None, False)


def gsm8k_reward(completion: str, answer_field: str) -> tuple[float, bool, bool]:
    """(reward, answer correct, format correct) of a completion against a GSM8K answer field."""
    predicted, format_ok = extract_answer(completion)
    gold = _as_number(reference_answer(answer_field))
    guess = None if predicted is None else _as_number(predicted)
    correct = guess is not None and gold is not None and guess == gold
    return float(correct) + 0.1 * (float(format_ok) - 1.0), correct, format_ok


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    use_chat = bool(getattr(setup.tokenizer, "chat_template", None))

    async def rollout_fn(row: dict) -> RolloutSample | None:
        question = row["question"]
        if use_chat:
            messages = [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]
            (completion,) = await setup.sampler.sample_with_tokens(messages=messages, n=1, **setup.sample_kwargs)
        else:
            prompt = setup.tokenizer.encode(f"Question: {question}\n{INSTRUCTION}\nAnswer:")
            (completion,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        n_prompt, n_generated = completion.prompt_len, len(completion.inference_logprobs)
        if n_generated == 0:
            return None
        reward, correct, format_ok = gsm8k_reward(completion.text, row["answer"])
        return RolloutSample(
            tokens=completion.full_tokens,
            logprobs=[0.0] * n_prompt + completion.inference_logprobs,
            loss_mask=[0] * n_prompt + [1] * n_generated,
            reward=reward,
            finish_reason=completion.finish_reason,
            text=completion.text,
            versions=[completion.versions[0]] * n_prompt + completion.versions,
            metrics={
                "correct": float(correct),
                "format_ok": float(format_ok),
                "truncated": float(completion.finish_reason == "length"),
            },
        )

    return rollout_fn
