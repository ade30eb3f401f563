"""A judge pool scaled on its own (issue 32 part 3 under compose: `docker compose up --scale judge=N`): with
`--judge-resolve-s S` each `--judge NAME:PORT` names a DNS name whose every address is a judge replica (compose's
service name), looked up again every S seconds, so the gateway's judge sampler spreads calls over every replica
and takes in replicas started later; a failed or empty lookup keeps the last list."""

from __future__ import annotations

import asyncio

import pytest

from fleetrl import RolloutSetup
from fleetrl.gateway.flags import build_parser, config_from_args
from fleetrl.gateway.judge import attach_judge, follow_judges, resolve_judges
from fleetrl.gateway.sampler import Sampler
from tests.waiting import async_wait_until


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["--rollout", "m:f", "--set", 'base_model="m"', *flags]))


def test_a_name_resolves_to_every_address_it_has() -> None:
    """Through the system resolver (compose's DNS answers a scaled service's name with one A record per replica)."""
    resolved = resolve_judges(["localhost:7001", "127.0.0.2:7002"])
    assert "127.0.0.1:7001" in resolved and "127.0.0.2:7002" in resolved
    assert resolved == sorted(set(resolved))
    with pytest.raises(ValueError, match="HOST:PORT"):
        resolve_judges(["judge"])


def test_the_resolve_flag_reaches_the_config_and_starts_with_no_fixed_replica() -> None:
    config = _config("--judge", "judge:50051", "--judge-resolve-s", "5")
    assert config.judge == ["judge:50051"] and config.judge_resolve_s == 5.0
    assert _config("--judge", "a:1").judge_resolve_s is None
    with pytest.raises(ValueError, match="judge_resolve_s"):
        _config("--judge", "a:1", "--judge-resolve-s", "0")
    # compose passes the flag always; without a judge it is unused, not refused
    assert _config("--judge", "", "--judge-resolve-s", "10").judge == []


async def test_attach_judge_with_resolution_waits_for_the_lookup() -> None:
    setup = RolloutSetup()
    sampler = attach_judge(setup, _config("--judge", "judge:50051", "--judge-resolve-s", "5"), None)
    assert sampler is not None and sampler.replicas == []  # the name itself is not a replica: its addresses are
    await sampler.close()


async def test_the_judge_list_follows_the_names_addresses() -> None:
    answers = [["10.0.0.2:50051"], [], ["10.0.0.2:50051", "10.0.0.3:50051"]]
    looked_up: list[list[str]] = []

    def resolve(names: list[str]) -> list[str]:
        looked_up.append(list(names))
        answer = answers[min(len(looked_up) - 1, len(answers) - 1)]
        if not answer:
            raise OSError("Temporary failure in name resolution")
        return answer

    sampler = Sampler(None)
    task = asyncio.create_task(follow_judges(sampler, ["judge:50051"], 0.01, resolve=resolve))
    try:
        await async_wait_until(lambda: len(looked_up) >= 3, 10, "three lookups")
        await async_wait_until(lambda: len(sampler.replicas) == 2, 10, "the scaled-up pool")
        assert sampler.replicas == ["10.0.0.2:50051", "10.0.0.3:50051"]
        assert looked_up[0] == ["judge:50051"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sampler.close()


async def test_a_failed_lookup_keeps_the_last_list() -> None:
    calls = 0

    def resolve(names: list[str]) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return ["10.0.0.2:50051"]
        raise OSError("Temporary failure in name resolution")

    sampler = Sampler(None)
    task = asyncio.create_task(follow_judges(sampler, ["judge:50051"], 0.01, resolve=resolve))
    try:
        await async_wait_until(lambda: calls >= 3, 10, "lookups after a failure")
        assert sampler.replicas == ["10.0.0.2:50051"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sampler.close()


async def test_a_running_gateway_follows_the_judge_name_and_stops_looking_when_it_stops() -> None:
    """The gateway's run loop starts the lookup beside its work (the controller here never answers) and ends it with
    the run: the judge sampler gets the name's addresses, and no lookup task outlives the gateway."""
    from fleetrl import Config
    from fleetrl.gateway.config import GatewayConfig
    from fleetrl.gateway.worker import Gateway

    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    config = GatewayConfig(
        run=run,
        rollout="unused:unused",
        controller_address="127.0.0.1:1",
        judge=["localhost:7001"],
        judge_resolve_s=0.05,
    )
    gateway = Gateway(config, rollout_factory=lambda setup: None)
    task = asyncio.create_task(gateway.run())
    try:
        await async_wait_until(lambda: getattr(gateway, "judge_sampler", None) is not None, 30, "the judge sampler")
        await async_wait_until(
            lambda: "127.0.0.1:7001" in gateway.judge_sampler.replicas, 30, "the judge name's addresses"
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "judge-lookup" and not t.done()]
