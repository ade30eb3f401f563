"""Rollout functions the `fleetrl up` integration tests run in real gateways (imported by module path)."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import random
from pathlib import Path

from fleetrl import RolloutSample, RolloutSetup


def _sample(completion, reward: float) -> RolloutSample:
    n_prompt, generated = completion.prompt_len, len(completion.inference_logprobs)
    first = completion.versions[0] if completion.versions else 0
    return RolloutSample(
        tokens=completion.full_tokens,
        logprobs=[0.0] * n_prompt + completion.inference_logprobs,
        loss_mask=[0] * n_prompt + [1] * generated,
        reward=reward,
        finish_reason=completion.finish_reason,
        text=completion.text,
        versions=[first] * n_prompt + completion.versions,
        metrics={"even_frac": reward},
    )


def make_rollout_fn(setup: RolloutSetup):
    """Reward: the fraction of generated tokens with an even id (a tiny model can move it)."""

    async def rollout_fn(row: dict) -> RolloutSample | None:
        prompt = setup.tokenizer.encode(row["prompt"])
        (completion,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
        generated = completion.completion_tokens
        reward = sum(1 for t in generated if t % 2 == 0) / max(len(generated), 1)
        return _sample(completion, reward)

    return rollout_fn


def make_slow_rollout_fn(setup: RolloutSetup):
    """The same with a slow tool call between sampling and scoring."""
    inner = make_rollout_fn(setup)

    async def rollout_fn(row: dict) -> RolloutSample | None:
        sample = await inner(row)
        await asyncio.sleep(float(setup.extras.get("tool_latency_s", 0.2)))
        return sample

    return rollout_fn


def make_faulty_rollout_fn(setup: RolloutSetup):
    """Every 7th call raises, every 5th returns None, every 6th returns a malformed sample; the rest are fine."""
    inner = make_rollout_fn(setup)
    calls = {"n": 0}

    async def rollout_fn(row: dict) -> RolloutSample | None:
        calls["n"] += 1
        n = calls["n"]
        if n % 7 == 0:
            raise ZeroDivisionError("the user's reward code divided by zero")
        if n % 5 == 0:
            return None
        sample = await inner(row)
        if n % 6 == 0:
            sample.loss_mask = [2] * len(sample.tokens)  # breaks the contract: mask values must be 0 or 1
        return sample

    return rollout_fn


def make_broken_rollout_fn(setup: RolloutSetup):
    """Always raises: the gateway's circuit breaker must stop the run with a clear message."""

    async def rollout_fn(row: dict) -> RolloutSample | None:
        raise KeyError(f"row has no field 'question': {sorted(row)}")

    return rollout_fn


async def broken_evaluate(setup: RolloutSetup, rows: list[dict]) -> dict[str, float]:
    """An evaluation hook that samples once, then fails (fleetrl eval must say so and exit 1)."""
    await setup.sampler.sample_with_prompt_tokens(setup.tokenizer.encode(rows[0]["prompt"]), n=1, max_tokens=2)
    raise RuntimeError("the grader is down")


def _next_call(counts_dir: Path, key: str) -> int:
    """How many calls for `key` came before this one, across gateway processes (a locked counter file)."""
    path = counts_dir / (hashlib.sha1(key.encode()).hexdigest() + ".count")
    with open(path, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        before = int(fh.read() or 0)
        fh.seek(0)
        fh.truncate()
        fh.write(str(before + 1))
    return before


def make_first_attempt_stale_rollout_fn(setup: RolloutSetup):
    """The first attempt of every row claims its tokens came from version 0 (stale once the policy moves on);
    each sample carries `metrics["attempt"]`, counted across gateways in `extras["attempt_dir"]`, so a run's
    metrics say which attempt of each row was trained."""
    inner = make_rollout_fn(setup)
    counts_dir = Path(setup.extras["attempt_dir"])
    group_size = setup.completions_per_prompt

    async def rollout_fn(row: dict) -> RolloutSample | None:
        attempt = _next_call(counts_dir, row["prompt"]) // group_size + 1
        sample = await inner(row)
        if attempt == 1:
            sample.versions = [0] * len(sample.tokens)
        sample.metrics = {**sample.metrics, "attempt": float(attempt)}
        return sample

    return rollout_fn


def make_version_logging_rollout_fn(setup: RolloutSetup):
    """The plain rollout, appending the oldest version behind each sample's generated tokens to
    `extras["version_log"]` (one line per sample), so a test sees which policy every rollout sampled from."""
    inner = make_rollout_fn(setup)
    log_path = Path(setup.extras["version_log"])

    async def rollout_fn(row: dict) -> RolloutSample | None:
        sample = await inner(row)
        generated = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(f"{min(generated)}\n")
        return sample

    return rollout_fn


def make_flaky_rollout_fn(setup: RolloutSetup):
    """A share (`extras["fail_share"]`) of rollouts fails before its first await, like a tool that errors at once:
    those failures resolve ahead of the successes started with them."""
    inner = make_rollout_fn(setup)
    share = float(setup.extras["fail_share"])
    rng = random.Random(0)

    async def rollout_fn(row: dict) -> RolloutSample | None:
        if rng.random() < share:
            raise RuntimeError("the sandbox died")
        return await inner(row)

    return rollout_fn


def make_held_rollout_fn(setup: RolloutSetup):
    """The plain rollout, whose "tool call" after sampling waits while `extras["hold_file"]` exists: a test holds
    the run still (no row finishes, no step) while it changes the replicas under it. `extras["tool_latency_s"]`
    (default 0) makes the tool call slow too, as in `make_slow_rollout_fn`. With `extras["hold_from_row"]` = n, only
    rows "count i ..." with i >= n wait: with the hold file made before the start and no shuffle, the first steps'
    rows finish and the run then stands still, whatever rows were already in flight."""
    inner = make_rollout_fn(setup)
    hold = Path(setup.extras["hold_file"])
    latency_s = float(setup.extras.get("tool_latency_s", 0.0))
    hold_from_row = int(setup.extras.get("hold_from_row", 0))

    async def rollout_fn(row: dict) -> RolloutSample | None:
        sample = await inner(row)
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        if hold_from_row and int(row["prompt"].split()[1]) < hold_from_row:
            return sample
        while hold.exists():
            await asyncio.sleep(0.05)
        return sample

    return rollout_fn


def make_lost_group_rollout_fn(setup: RolloutSetup):
    """The plain rollout, except that the first attempt of the row whose prompt starts with `extras["huge_prompt"]`
    returns a first sample of `extras["huge_tokens"]` tokens: a group over the trainer's 32 MiB frame cap, which its
    socket drops without a word (the gateway's own cap raised with --max-group-mb so it sends it)."""
    inner = make_rollout_fn(setup)
    huge_prompt, n = str(setup.extras["huge_prompt"]), int(setup.extras["huge_tokens"])

    async def rollout_fn(row: dict, attempt: int = 1, rollout_idx: int = 0) -> RolloutSample | None:
        if row["prompt"].startswith(huge_prompt) and attempt == 1 and rollout_idx == 0:
            return RolloutSample(
                tokens=[1] * n, logprobs=[-0.5] * n, loss_mask=[0] + [1] * (n - 1), reward=0.0, versions=[0] * n
            )
        return await inner(row)

    return rollout_fn
