"""`fleetrl serve inference --engine hf` as a real process: ports from its ready file, gRPC, HTTP, /metrics, a
weight load logged with its pause, clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from transformers import AutoModelForCausalLM

from fleetrl.ready_file import wait_ready_file
from fleetrl.rpc import open_channel
from fleetrl.v1 import inference_pb2, inference_pb2_grpc
from fleetrl.weights import WeightPublisher

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a `fleetrl serve inference` process


class _Lines:
    """stderr lines of a process, readable with a timeout."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.put(line)

    def wait_for(self, pattern: re.Pattern | str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s}s; got:\n{''.join(self.seen)}")


def _get(url: str, token: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.read().decode()


async def test_the_launched_server_serves_everything_and_stops_cleanly(tiny_model_dir: str, tmp_path) -> None:
    env = dict(os.environ, FLEETRL_AUTH_TOKEN="launch-token")
    cmd = [
        sys.executable,
        "-m",
        "fleetrl",
        "serve",
        "inference",
        "--model",
        tiny_model_dir,
        "--engine",
        "hf",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--ready-file",
        str(tmp_path / "ready.json"),
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = _Lines(proc)
        ready = await asyncio.to_thread(wait_ready_file, tmp_path / "ready.json", 120, proc)
        # `fleetrl up` and compose read these
        assert set(ready) == {"host", "grpc_port", "http_port", "metrics_port", "relay_address"}
        assert ready["host"] == "127.0.0.1"
        grpc_port, http_port, metrics_port = ready["grpc_port"], ready["http_port"], ready["metrics_port"]
        lines.wait_for(rf"inference server up: .* grpc 127\.0\.0\.1:{grpc_port}, http {http_port}", 10)
        models = json.loads(_get(f"http://127.0.0.1:{http_port}/v1/models", "launch-token"))
        assert models["data"][0]["id"] == os.path.basename(tiny_model_dir)
        state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        async with open_channel(f"127.0.0.1:{grpc_port}", auth_token="launch-token") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            reply = await stub.Generate(
                inference_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], n=2, max_tokens=4),
                timeout=30,
            )
            assert len(reply.completions) == 2
            with WeightPublisher(auth_token="launch-token") as publisher:
                publisher.publish(3, {k: v * 0.99 for k, v in state.items()})
                await stub.LoadWeights(
                    inference_pb2.LoadWeightsRequest(version=3, source=publisher.address), timeout=60
                )
            status = await stub.Status(inference_pb2.StatusRequest(), timeout=10)
            assert status.loaded_version == 3
        lines.wait_for(r"loaded weights version 3 .*pause \d+\.\d+ s", 10)
        metrics = _get(f"http://127.0.0.1:{metrics_port}/metrics", "")
        assert "fleetrl_inference_loaded_version 3.0" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
