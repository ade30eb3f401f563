"""`fleetrl up` with weight_transport = "collective" (docs/inference.md, "Collective loads"): every version the
controller pushes reaches both hf replicas by broadcast in the trainer's gloo group, none over the weight stream,
and the run trains to the end with the off-policy bound kept."""

from __future__ import annotations

import re

import pytest

from tests.integration.up.conftest import fleetrl_up, read_metrics, write_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE_LOADED = re.compile(r"loaded weights version (\d+) \(checksum \w+\) from (\S+) \((\w+)\)")


def test_a_collective_run_broadcasts_every_version_to_both_replicas(tmp_path, tiny_model_dir):
    config = write_run(
        tmp_path,
        tiny_model_dir,
        {"max_steps": 3, "weight_transport": "collective", "max_head_offpolicy_versions": 1},
        {"replicas": 2},
        n_rows=12,
    )
    result = fleetrl_up(config)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert [m["step"] for m in read_metrics(run_dir) if "train/loss" in m] == [1, 2, 3]
    loads: dict[int, list[str]] = {}
    for log in sorted(run_dir.glob("inference-*.log")):
        for version, _, transport in ENGINE_LOADED.findall(log.read_text()):
            loads.setdefault(int(version), []).append(transport)
    # Each version pushed during the run (the last step's version may land after the rows ran out) went to both
    # replicas by broadcast; a catch-up of a fenced replica (over the stream) would show as "zmq".
    assert loads and all(transports == ["collective", "collective"] for transports in loads.values()), loads
    assert 1 in loads
