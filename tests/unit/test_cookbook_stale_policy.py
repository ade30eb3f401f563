"""`fleetrl.cookbook.Config` keeps the cookbook's `stale_policy = "train"`, which turns off fleetrl's per-sample
staleness bound: it says so once, at start, naming the setting that gives the bound back."""

from __future__ import annotations

import logging

import pytest

from fleetrl import cookbook


@pytest.fixture(autouse=True)
def not_warned_yet(monkeypatch):
    monkeypatch.setattr(cookbook, "_warned_stale_policy", False)


def test_the_cookbooks_default_warns_once_naming_the_per_sample_bound(caplog):
    with caplog.at_level(logging.WARNING, logger="fleetrl.cookbook"):
        cfg = cookbook.Config(base_model="unused", dataset="unused", max_head_offpolicy_versions=2)
        cookbook.Config(base_model="unused", dataset="unused")
    assert cfg.stale_policy == "train"
    (record,) = [r for r in caplog.records if "stale_policy" in r.getMessage()]  # once, for both
    message = record.getMessage()
    assert "bounds staleness only when a row is admitted" in message
    assert "more than max_head_offpolicy_versions (2) versions behind" in message
    assert "stale_policy = 'requeue'" in message and "bounds every trained sample" in message


@pytest.mark.parametrize("policy", ["train", "requeue"])
def test_a_stale_policy_chosen_explicitly_is_not_warned_about(caplog, policy):
    with caplog.at_level(logging.WARNING, logger="fleetrl.cookbook"):
        cfg = cookbook.Config(base_model="unused", dataset="unused", stale_policy=policy)
    assert cfg.stale_policy == policy and "stale_policy" not in caplog.text
