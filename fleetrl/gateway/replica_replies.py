"""Whether an inference replica's Generate reply can be true, and which replicas keep answering garbage (pure, no I/O).

`reply_fault` names what makes a reply impossible: a completion count other than the request's n, a token id outside
the vocabulary, a logprob that is not finite or is positive, token, logprob and version lists of different lengths,
or a policy version that is negative or above the newest the run can have produced. Such a reply is the replica's
fault, not the rollout's: the sampler counts it against the replica, asks another one, and `ReplicaHealth` fences
(for the gateway's own routing) a replica that answers garbage `max_bad_in_a_row` times in a row, for `fence_s`,
doubling up to `max_fence_s` each time it is fenced again before a good reply.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.clients.inference_types import SamplingRequest

LOGPROB_TOLERANCE = 1e-4
"""A logprob above this is refused as positive: log-softmax is <= 0, and a hair above 0 is float rounding."""


def reply_fault(
    request: SamplingRequest,
    completions: Sequence[Any],
    *,
    vocab_size: int | None = None,
    max_version: int | None = None,
) -> str | None:
    """Why `completions` cannot be a true answer to `request` (None: nothing wrong). `max_version` is the newest
    policy version a replica may serve (None: not known, only negative versions are refused)."""
    if len(completions) != request.n:
        return f"{len(completions)} completions for a request of n = {request.n}"
    for i, completion in enumerate(completions):
        tokens = getattr(completion, "token_ids", None)
        logprobs = getattr(completion, "logprobs", None)
        versions = getattr(completion, "versions", None)
        if tokens is None or logprobs is None or versions is None:
            return f"completion {i} is not a completion ({type(completion).__name__})"
        if len(logprobs) != len(tokens):
            return f"completion {i}: {len(tokens)} token ids but {len(logprobs)} logprobs"
        if versions and len(versions) != len(tokens):
            return f"completion {i}: {len(tokens)} token ids but {len(versions)} versions"
        bad = [
            t
            for t in tokens
            if not (isinstance(t, numbers.Integral) and t >= 0 and (vocab_size is None or t < vocab_size))
        ]
        if bad:
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, ...)"
            return f"completion {i}: token ids outside the vocabulary {bound}: {bad[:5]}"
        bad_lp = [x for x in logprobs if not (math.isfinite(x) and x <= LOGPROB_TOLERANCE)]
        if bad_lp:
            return f"completion {i}: logprobs not finite or positive: {bad_lp[:5]}"
        too_new = max_version is not None and any(v > max_version for v in versions)
        if any(v < 0 for v in versions) or too_new:
            odd = [v for v in versions if v < 0 or (max_version is not None and v > max_version)]
            ceiling = "" if max_version is None else f" (the run's newest is {max_version})"
            return f"completion {i}: impossible policy versions {odd[:5]}{ceiling}"
    return None


def newest_version(completions: Sequence[Any]) -> int | None:
    """The highest policy version in a reply (None: it names none)."""
    found = [max(c.versions) for c in completions if getattr(c, "versions", None)]
    return max(found) if found else None


@dataclass
class _Record:
    bad_in_a_row: int = 0
    fences: int = 0  # times fenced since its last good reply
    fenced_until: float = -math.inf


@dataclass
class ReplicaHealth:
    """Per replica address: garbage replies in a row, and whether the gateway routes around it now (`now`: a
    monotonic clock's reading, given by the caller). After a fence ends the replica gets one call on probation:
    another bad reply fences it again at once, for twice as long."""

    max_bad_in_a_row: int = 3
    fence_s: float = 30.0
    max_fence_s: float = 600.0
    bad_replies: dict[str, int] = field(default_factory=dict)  # every garbage reply, per replica (a metric)
    fenced_total: int = 0
    _records: dict[str, _Record] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_bad_in_a_row < 1:
            raise ValueError(f"max_bad_in_a_row must be >= 1, got {self.max_bad_in_a_row}")
        if not 0 < self.fence_s <= self.max_fence_s:
            raise ValueError(f"need 0 < fence_s <= max_fence_s, got {self.fence_s} and {self.max_fence_s}")

    def good(self, address: str) -> None:
        self._records.pop(address, None)

    def bad(self, address: str, now: float) -> float | None:
        """A garbage reply from `address`: the seconds it is fenced for now, or None (not fenced)."""
        self.bad_replies[address] = self.bad_replies.get(address, 0) + 1
        record = self._records.setdefault(address, _Record())
        record.bad_in_a_row += 1
        if record.bad_in_a_row < self.max_bad_in_a_row:
            return None
        seconds = min(self.fence_s * 2**record.fences, self.max_fence_s)
        record.fences += 1
        record.fenced_until = now + seconds
        self.fenced_total += 1
        return seconds

    def fenced(self, address: str, now: float) -> bool:
        record = self._records.get(address)
        return record is not None and now < record.fenced_until
