"""Sampling seeds derived from what a sample is, so that the same run samples the same tokens.

The gateway opens a `RolloutSeedScope` around each call of the user's rollout function; the sampler asks it for
`next_seed()` on every sampling call that carries no seed of its own:

    with rollout_seed_scope(RolloutKey(run_seed=0, row_id=17, version=3, sample_index=2)):
        await rollout_fn(row)        # sample_with_* call c of this rollout uses derive_seed(0, 17, 3, 2, c)

The seed is a 62-bit blake2b digest of (run seed, row id, policy version the row was leased at, sample index in
its group, call index within the rollout), never Python's salted `hash()`. The version stands where an attempt
counter might: a row leased again at the same version (a failed send, an expired lease, the rows a resumed run
trains again after a crash) draws exactly the samples it would have drawn, which is what lets a resumed run end
with the weights of an uninterrupted one; a row requeued as stale is leased at a newer version and so draws fresh
ones. Outside a scope (evaluation hooks, `fleetrl eval`) `next_rollout_seed()` is None and requests stay unseeded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

SEED_BITS = 62
"""Below the engines' 2**63 bound with room to spare: completion i of an n-sample request uses seed + i."""


def derive_seed(run_seed: int, row_id: int, version: int, sample_index: int, call_index: int) -> int:
    """A seed in [0, 2**62) that depends only on its arguments (the same on every machine and Python process)."""
    key = f"fleetrl-sample/{run_seed}/{row_id}/{version}/{sample_index}/{call_index}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@dataclass(frozen=True)
class RolloutKey:
    """What one rollout is: sample `sample_index` of row `row_id`, leased at policy version `version`."""

    run_seed: int
    row_id: int
    version: int
    sample_index: int


@dataclass
class RolloutSeedScope:
    """Seeds for the successive sampling calls of one rollout (each turn of a multi-turn rollout its own)."""

    key: RolloutKey
    calls: int = field(default=0)

    def next_seed(self) -> int:
        k = self.key
        seed = derive_seed(k.run_seed, k.row_id, k.version, k.sample_index, self.calls)
        self.calls += 1
        return seed


_SCOPE: ContextVar[RolloutSeedScope | None] = ContextVar("fleetrl_rollout_seed_scope", default=None)


@contextmanager
def rollout_seed_scope(key: RolloutKey) -> Iterator[RolloutSeedScope]:
    """Seed the sampling calls made in this context (and in tasks it starts) from `key`, counting from call 0."""
    scope = RolloutSeedScope(key)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


def next_rollout_seed() -> int | None:
    """The seed for the next sampling call of the current rollout, or None outside a rollout."""
    scope = _SCOPE.get()
    return None if scope is None else scope.next_seed()


@contextmanager
def member_seed_scope(member: int) -> Iterator[RolloutSeedScope | None]:
    """Inside a group rollout's scope (sample index s), seed member `member`'s calls as sample s + member, so each
    member of a group sampled concurrently gets seeds of its own in a fixed order. No-op outside a scope."""
    parent = _SCOPE.get()
    if parent is None:
        yield None
        return
    k = parent.key
    with rollout_seed_scope(RolloutKey(k.run_seed, k.row_id, k.version, k.sample_index + member)) as scope:
        yield scope
