"""`fleetrl up`, the controller and a config check do not import torch (about 1 s of CPU per process on a small
machine, paid at every run's start; issue 19's start-up figure). The torch parts of fleetrl.losses and
fleetrl.weights load on first use (fleetrl/lazy_import.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetrl.lazy_import import lazy_names

CHECK = """
import sys
import fleetrl.up.run, fleetrl.services.controller.server, fleetrl.services.controller.orchestrator
from fleetrl.config import Config
Config(base_model="m", dataset="d", policy_loss="grpo")
print(sorted(m for m in ("torch", "zmq", "transformers") if m in sys.modules))
"""


def test_fleetrl_up_the_controller_and_a_config_check_import_no_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True).stdout
    assert "torch" not in out and "transformers" not in out, out


def test_the_lazy_names_load_their_module_on_first_use():
    from fleetrl import losses, weights

    assert callable(losses.policy_loss) and losses.masked_mean.__module__ == "fleetrl.losses.aggregation"
    assert weights.WeightPublisher.__module__ == "fleetrl.weights.publisher"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lazy_names("fleetrl.losses", {})("nope")
