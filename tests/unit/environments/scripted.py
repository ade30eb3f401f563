"""A scripted sampler behind the real agent session server, for the environment adapters' tests: each call replays
the next reply's tokens with made-up logprobs, and the run's `RolloutSetup` opens real sessions on it."""

from __future__ import annotations

from fleetrl import Config, RolloutSetup
from fleetrl.gateway.sampler import SampledCompletion


class ScriptedSampler:
    """Replays fixed replies (text -> tokens + <|im_end|>), recording each call's prompt."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.prompts.append(list(prompt))
        text = self.replies.pop(0)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokens = [*self.tokenizer.encode(text, add_special_tokens=False), end]
        logprobs = [-0.01 * (i + 1) - 0.5 * len(self.prompts) for i in range(len(tokens))]
        return [SampledCompletion(list(prompt) + tokens, len(prompt), logprobs, "stop", text, [7] * len(tokens))]


def scripted_setup(tokenizer, model_dir: str, replies: list[str], **extras) -> RolloutSetup:
    run = Config(base_model=model_dir, dataset="unused", max_completion_tokens=16, rollout_extras=extras)
    return RolloutSetup.for_run(run, tokenizer, ScriptedSampler(tokenizer, replies))


def trained_and_generated(session_turns, samples) -> tuple[list, list]:
    """(token, logprob) of every trained token of `samples`, and of every token the server generated."""
    trained = [(t, lp) for s in samples for t, lp, m in zip(s.tokens, s.logprobs, s.loss_mask, strict=True) if m]
    generated = [(t, lp) for u in session_turns for t, lp in zip(u.completion_token_ids, u.logprobs, strict=True)]
    return trained, generated
