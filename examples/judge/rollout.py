"""The arithmetic task with its reward from a judge model (run by the gateways under `fleetrl up`; [up] judge_model).

The policy answers `37+48=`; the judge, a frozen model of its own pool (`setup.judge_sampler`, never sent weights), is
asked the same problem greedily and its answer is the reference: reward 1 when the policy's answer equals the
judge's (a generative reward model in the small, as LLM-as-judge is in the large). The true sum is never used for
the reward, only reported (`env/all/correct`, and the judge's own accuracy `env/all/judge_correct`). The judge's
verdict of one problem is the same for every sample of the group, so it is asked once per row and cached.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from fleetrl import RolloutSample, RolloutSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic"))
from arithmetic_task import score


def make_rollout_fn(setup: RolloutSetup):
    if setup.judge_sampler is None:
        raise RuntimeError("examples/judge needs a judge pool: set [up] judge_model (fleetrl up starts it)")
    judge = setup.judge_sampler
    verdicts: dict[str, asyncio.Task[str | None]] = {}

    async def ask_judge(prompt: str) -> str | None:
        """The judge's greedy answer to `prompt`, or None when it did not finish one."""
        ids = judge.tokenizer.encode(prompt)
        (c,) = await judge.sample_with_prompt_tokens(
            ids, n=1, max_tokens=setup.sample_kwargs["max_tokens"], temperature=0.0
        )
        return c.text.strip() if c.finish_reason == "stop" else None

    async def rollout_fn(row: dict) -> RolloutSample | None:
        if row["prompt"] not in verdicts:  # one judge call per problem, shared by the group's samples
            verdicts[row["prompt"]] = asyncio.ensure_future(ask_judge(row["prompt"]))
        prompt = setup.tokenizer.encode(row["prompt"])
        (c,), reference = await asyncio.gather(
            setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs), verdicts[row["prompt"]]
        )
        finished = c.finish_reason == "stop"
        reward = score(c.text, reference, finished=finished) if reference else 0.0
        generated = len(c.inference_logprobs)
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * generated,
            reward=reward,
            finish_reason=c.finish_reason,
            text=c.text,
            versions=[c.versions[0] if c.versions else 0] * c.prompt_len + c.versions,
            metrics={
                "judged": float(reference is not None),
                "judge_correct": float(reference == row["answer"]),
                "correct": score(c.text, row["answer"], finished=finished),
            },
        )

    return rollout_fn
