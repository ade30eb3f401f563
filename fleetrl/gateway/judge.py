"""The judge pool as the rollout reaches it: `attach_judge(setup, config, tokenizer)` puts on the `RolloutSetup` a
`Sampler` over the judge replicas (`setup.judge_sampler`, the cookbook interface the policy's sampler has), the first
replica's OpenAI base URL (`setup.judge_base_url`), the judge's model name and the key its HTTP API takes.

The judge replicas are inference replicas of another model that `fleetrl up` starts beside the policy's ([up]
judge_model): frozen, never told to the controller, so never sent weights and never fenced or re-listed; the
sampler's list is the fixed one from the gateway's `--judge` flags, or, with `--judge-resolve-s S` (compose's judge
service scaled with `--scale judge=N`), every address each `--judge NAME:PORT` resolves to, looked up again every S
seconds by `follow_judges` (replicas started later join; a failed lookup keeps the last list).

    async def rollout_fn(row):
        ...
        verdict = await setup.judge_sampler.sample_with_tokens(messages=[...], n=1, max_tokens=8, temperature=0.0)
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import Sampler
from fleetrl.rollout import RolloutSetup

log = logging.getLogger(__name__)


def attach_judge(setup: RolloutSetup, config: GatewayConfig, tokenizer: Any) -> Sampler | None:
    """Fill `setup`'s judge fields from `config` (`tokenizer`: the judge's, for chat messages); returns the judge
    sampler (the caller closes it), or None when the gateway was given no judge."""
    if not config.judge:
        return None
    # Resolved: the names are not replicas, their addresses are (follow_judges fills the list).
    return attach_judge_pool(
        setup,
        [] if config.judge_resolve_s is not None else list(config.judge),
        tokenizer,
        base_url=config.judge_base_url,
        model=config.judge_model,
        auth_token=config.auth_token,
        request_timeout_s=config.generate_timeout_s,
        replica_wait_s=config.replica_wait_s,
    )


def attach_judge_pool(
    setup: RolloutSetup,
    addresses: Sequence[str],
    tokenizer: Any,
    *,
    base_url: str | None,
    model: str | None,
    auth_token: str | None,
    request_timeout_s: float = 600.0,
    replica_wait_s: float = 300.0,
) -> Sampler:
    """Put on `setup` a judge sampler over `addresses` (HOST:PORT of each judge replica), the judge's OpenAI base URL,
    model and API key; returns the sampler (the caller closes it). A gateway's and `fleetrl eval`'s judge alike."""
    sampler = Sampler(
        tokenizer, auth_token=auth_token, request_timeout_s=request_timeout_s, replica_wait_s=replica_wait_s
    )
    sampler.set_replicas(list(addresses))
    setup.judge_sampler = sampler
    setup.judge_base_url = base_url
    setup.judge_model = model
    setup.judge_api_key = auth_token
    return sampler


def load_judge_tokenizer(config: GatewayConfig, fallback: Any) -> Any:
    """The judge model's tokenizer (`judge_model`), or `fallback` (the run's) when no judge model is named."""
    if not config.judge or not config.judge_model:
        return fallback
    from fleetrl.tokenizer_load import load_tokenizer

    return load_tokenizer(config.judge_model)  # as AutoTokenizer, without importing torch when it can


def resolve_judges(names: Sequence[str]) -> list[str]:
    """Every address each HOST:PORT in `names` resolves to (one per replica of a scaled compose service), as sorted
    HOST:PORT strings; OSError when a lookup fails, ValueError for a name without a port."""
    addresses: set[str] = set()
    for name in names:
        host, sep, port = name.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"judge: {name!r} is not HOST:PORT")
        host = host.strip("[]")
        for family, _, _, _, sockaddr in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM):
            ip = str(sockaddr[0])
            addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


async def follow_judges(
    sampler: Sampler,
    names: Sequence[str],
    every_s: float,
    *,
    resolve: Callable[[list[str]], list[str]] = resolve_judges,
) -> None:
    """Keep `sampler`'s replicas the addresses `names` resolve to, looked up every `every_s` seconds (sooner, at most
    every second, while a judge call finds no replica). Runs until cancelled; a failed or empty lookup keeps the last
    list (a call waits up to the sampler's replica_wait_s for one)."""
    names = list(names)
    while True:
        try:
            addresses = await asyncio.to_thread(resolve, names)
        except OSError as exc:
            addresses = []
            log.debug("judge lookup of %s failed: %s", names, exc)
        if addresses and addresses != sampler.replicas:
            log.info("judge replicas: %s", ", ".join(addresses))
            sampler.set_replicas(addresses)
        pause = every_s if sampler.replicas else min(every_s, 1.0)
        await asyncio.sleep(min(pause, 1.0) if sampler.wants_replicas else pause)
