"""A gateway started beside the controller (`--controller-ready-file`): it reads the address once the controller
serves, and a controller that never comes up is an error naming the file, not a hang."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from fleetrl import Config, ready_file
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.flags import build_parser, config_from_args
from fleetrl.gateway.worker import Gateway
from fleetrl.ready_file import write_ready_file


def gateway(tmp_path, ready, timeout_s: float) -> Gateway:
    run = Config(base_model="unused", dataset="unused", completions_per_prompt=2)
    config = GatewayConfig(
        run=run, rollout="unused:unused", controller_ready_file=str(ready), controller_ready_timeout_s=timeout_s
    )
    return Gateway(config, rollout_factory=lambda setup: None)


def test_no_controller_ready_file_in_time_is_an_error_naming_it(tmp_path):
    ready = tmp_path / "ready" / "controller.json"
    with pytest.raises(TimeoutError, match=r"controller\.json"):
        asyncio.run(gateway(tmp_path, ready, 0.2).run())


def test_the_address_comes_from_the_file_once_written(tmp_path, monkeypatch):
    import fleetrl.gateway.worker as worker

    ready = tmp_path / "controller.json"
    gw = gateway(tmp_path, ready, 60)
    seen = []

    def fake_channel(address, token):
        seen.append(address)
        raise RuntimeError("stop here")

    monkeypatch.setattr(worker, "open_channel", fake_channel)
    looked = threading.Event()  # the gateway found no file and waits for one
    real_time = ready_file.time
    monkeypatch.setattr(
        ready_file,
        "time",
        SimpleNamespace(monotonic=real_time.monotonic, sleep=lambda s: looked.set() or real_time.sleep(s)),
    )

    async def main():
        async def write_later():
            assert await asyncio.to_thread(looked.wait, 30), "the gateway never waited for the ready file"
            write_ready_file(ready, {"address": "127.0.0.1:1"})

        writer = asyncio.create_task(write_later())  # the controller comes up after the gateway started
        with pytest.raises(RuntimeError, match="stop here"):
            await gw.run()
        await writer

    asyncio.run(main())
    assert seen == ["127.0.0.1:1"] and gw.controller_address == "127.0.0.1:1"
    assert json.loads(ready.read_text())["address"] == "127.0.0.1:1"


def test_the_flags_set_the_file_and_its_timeout(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('base_model = "unused"\ndataset = "unused"\ncompletions_per_prompt = 2\n')
    argv = ["--config", str(run), "--rollout", "m:f", "--controller-ready-file", "r.json"]
    config = config_from_args(build_parser().parse_args([*argv, "--controller-ready-timeout", "5"]))
    assert config.controller_ready_file == "r.json" and config.controller_ready_timeout_s == 5.0
