"""The judge pool of `fleetrl up` (issue 32 part 3): [up] judge_model starts `judge_replicas` frozen inference replicas
of another model (the same inference service; the controller is never told of them, so they are never sent
weights), and every gateway gets their gRPC addresses and the first one's OpenAI base URL. Judge settings without a
judge_model are refused naming the field. The command lines are recorded; no process starts."""

from __future__ import annotations

import io

import pytest

from fleetrl.config import Config, ConfigError
from fleetrl.up import run as up_run
from fleetrl.up.config import UpConfig
from fleetrl.up.supervisor import Supervisor
from tests.unit.up.test_reference_placement import _sixteen_cpus, flag, started_stack, up_config

__all__ = ["_sixteen_cpus"]  # the autouse fixture, for this module too


def test_a_judge_pool_is_started_beside_the_replicas_and_never_given_to_the_controller(tmp_path, monkeypatch):
    run = Config(base_model="m", kl_beta=0.0)
    up = up_config(tmp_path, judge_model="judge", judge_replicas=2, judge_args=["--max-batch-size", "4"])
    started: list[list[str]] = []

    class FakePopen:  # records the command line; no process is started
        def __init__(self, argv, **kwargs):
            self.argv, self.pid = argv, 0
            started.append(argv)

    monkeypatch.setattr("fleetrl.up.supervisor.subprocess.Popen", FakePopen)
    sup = Supervisor(tmp_path / "logs")
    monkeypatch.setattr(sup, "wait_ready", lambda child, *a, **k: {"grpc_port": 7000 + len(sup.children)})
    infos = up_run.start_judges(sup, run, up, up_run._thread_plan(run, up), io.StringIO())
    assert [child.name for child in sup.children] == ["judge-0", "judge-1"]
    assert [info["grpc_port"] for info in infos] == [7002, 7002]  # what each ready file said
    for child in sup.children:
        argv = child.argv
        assert flag(argv, "--model") == "judge" and flag(argv, "--engine") == "hf"
        assert flag(argv, "--max-batch-size") == "4"
        assert "--max-lora-rank" not in argv
    # The stack itself is unchanged: the controller is told of the policy replica only (the judges are never
    # pushed weights), and nothing else waits for the judges.
    services = started_stack(tmp_path / "stack", monkeypatch, run, up)
    controller = services["controller"]["argv"]
    assert len([a for a in controller if a == "--inference"]) == 1
    assert not any(name.startswith("judge") for name in services)
    assert up_run.start_judges(sup, run, up_config(tmp_path), None, io.StringIO()) == []


def test_the_gateways_get_the_judge_pool(tmp_path):
    judges = [{"grpc_port": 7001, "http_port": 8001}, {"grpc_port": 7002, "http_port": 8002}]
    up = up_config(tmp_path, judge_model="judge")
    assert up_run.judge_gateway_flags(up, judges) == [
        "--judge",
        "127.0.0.1:7001",
        "--judge",
        "127.0.0.1:7002",
        "--judge-base-url",
        "http://127.0.0.1:8001/v1",
        "--judge-model",
        "judge",
    ]
    assert up_run.judge_gateway_flags(up_config(tmp_path), []) == []


@pytest.mark.parametrize(
    ("up", "message"),
    [
        ({"judge_replicas": 2}, "judge_replicas is a judge pool setting: it needs judge_model"),
        ({"judge_args": ["--x"]}, "judge_args is a judge pool setting: it needs judge_model"),
        ({"judge_engine": "hf"}, "judge_engine is a judge pool setting: it needs judge_model"),
        ({"judge_model": "j", "judge_replicas": 0}, "judge_replicas"),
    ],
)
def test_judge_settings_without_a_judge_are_refused_naming_the_field(tmp_path, up, message):
    with pytest.raises(ConfigError, match=message):
        UpConfig.from_dict({"rollout": "m:f", **up}, source="run.toml")
