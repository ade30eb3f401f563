"""How many rows a gateway keeps in flight by default: enough for every row the off-policy gate admits at once, so
an async run's O versions of rollouts overlap (issue 19: with 16, O = 2 barely helped over O = 1)."""

from __future__ import annotations

import pytest

from fleetrl import Config
from fleetrl.gateway.config import GatewayConfig


def rows(**run):
    config = Config(base_model="unused", dataset="unused", **run)
    return GatewayConfig(run=config, rollout="unused:unused").rows_in_flight


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ({"prompt_groups_per_step": 16, "max_head_offpolicy_versions": 2}, 48),
        ({"prompt_groups_per_step": 16, "max_head_offpolicy_versions": 1}, 32),
        ({"prompt_groups_per_step": 16, "synchronous_training": True}, 16),
        ({"prompt_groups_per_step": 4, "max_head_offpolicy_versions": 1}, 16),  # never below the old 16
    ],
)
def test_without_max_concurrency_the_gateway_keeps_what_the_gate_admits(run, expected):
    assert rows(**run) == expected


def test_max_concurrency_and_an_explicit_figure_still_decide():
    assert (
        rows(prompt_groups_per_step=16, max_head_offpolicy_versions=2, completions_per_prompt=8, max_concurrency=64)
        == 9
    )
    config = Config(base_model="unused", dataset="unused", prompt_groups_per_step=16, max_head_offpolicy_versions=2)
    assert GatewayConfig(run=config, rollout="unused:unused", max_rows_in_flight=5).rows_in_flight == 5
