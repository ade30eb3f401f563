"""Control-plane throughput: rollouts/s that the real controller + one real gateway sustain when inference and
training cost nothing, and the latency the control plane adds per row.

    python bench/control_plane.py [--groups-per-step 64] [--group-size 8] [--steps 30]

The controller and the gateway run as real processes (`fleetrl serve ...`); the rollout function returns a fixed
sample without calling inference (bench/control_plane_rollout.py); the trainer and the inference replica are
stand-ins in this process that answer TrainStep / LoadWeights at once — but the rollout groups still travel over
real ZeroMQ and are decoded and validated as the trainer does. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetrl.group_stream import GroupReceiver
from fleetrl.ready_file import wait_ready_file
from fleetrl.rpc import create_grpc_server
from fleetrl.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


class InstantTrainer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, groups_address: str) -> None:
        self.groups_address = groups_address

    async def TrainStep(self, request, context):
        return trainer_pb2.TrainStepResponse(
            step=request.step, version=request.step, published=True, weights_address="tcp://127.0.0.1:1"
        )

    async def Status(self, request, context):
        return trainer_pb2.TrainerStatusResponse(groups_address=self.groups_address)

    async def Finish(self, request, context):
        return trainer_pb2.FinishResponse()


class InstantInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.version = 0

    async def Status(self, request, context):
        return inference_pb2.StatusResponse(engine="instant", loaded_version=self.version)

    async def LoadWeights(self, request, context):
        self.version = request.version
        return inference_pb2.LoadWeightsResponse(version=request.version)


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleetrl", "serve", *args]


async def run(groups_per_step: int, group_size: int, steps: int, offpolicy: int, rows_in_flight: int) -> dict:
    received = {"groups": 0}
    receiver = GroupReceiver(on_group=lambda g: received.__setitem__("groups", received["groups"] + 1)).start()
    trainer_server, trainer_port = create_grpc_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(InstantTrainer(receiver.address), s)]
    )
    inference_server, inference_port = create_grpc_server(
        [lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(InstantInference(), s)]
    )
    await trainer_server.start()
    await inference_server.start()
    work = Path(tempfile.mkdtemp(prefix="fleetrl-bench-cp-"))
    rows = work / "rows.jsonl"
    rows.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(groups_per_step * steps)))
    run_cfg = {
        "base_model": "unused",
        "dataset": str(rows),
        "log_path": str(work / "run"),
        "kl_beta": 0.0,
        "completions_per_prompt": group_size,
        "prompt_groups_per_step": groups_per_step,
        "max_head_offpolicy_versions": offpolicy,
        "max_steps": steps,
        "shuffle": False,
    }
    config = work / "run.json"
    config.write_text(json.dumps({"run": run_cfg}))
    logs = {name: open(work / f"{name}.log", "w") for name in ("controller", "gateway")}  # noqa: SIM115
    controller = subprocess.Popen(
        serve_cmd(
            "controller",
            "--config",
            str(config),
            "--trainer",
            f"127.0.0.1:{trainer_port}",
            "--inference",
            f"127.0.0.1:{inference_port}",
            "--grpc-port",
            "0",
            "--no-metrics",
            "--ready-file",
            str(work / "controller.json"),
        ),
        stdout=logs["controller"],
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    address = (await asyncio.to_thread(wait_ready_file, work / "controller.json", 60, controller))["address"]
    gateway = subprocess.Popen(
        serve_cmd(
            "gateway",
            "--config",
            str(config),
            "--rollout",
            "bench/control_plane_rollout.py:make_rollout_fn",
            "--controller",
            address,
            "--max-rows-in-flight",
            str(rows_in_flight),
            "--set",
            f'tokenizer_model="{TOKENIZER}"',
        ),
        stdout=logs["gateway"],
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        await asyncio.to_thread(controller.wait, 600)
        await asyncio.to_thread(gateway.wait, 60)
    finally:
        for p in (controller, gateway):
            if p.poll() is None:
                p.kill()
        await trainer_server.stop(0)
        await inference_server.stop(0)
        receiver.stop()
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    span = metrics[-1]["time"] - metrics[0]["time"]
    rollouts = (len(metrics) - 1) * groups_per_step * group_size  # steps after the first (startup excluded)
    gateway_log = (work / "gateway.log").read_text()
    p50, p99 = (float(x) for x in re.search(r"p50=([0-9.]+) ms p99=([0-9.]+) ms", gateway_log).groups())
    return {
        "steps": len(metrics),
        "groups_received": received["groups"],
        "rollouts_per_s": rollouts / span,
        "rows_per_s": rollouts / group_size / span,
        "row_latency_p50_ms": p50,
        "row_latency_p99_ms": p99,
        "controller_rc": controller.returncode,
        "gateway_rc": gateway.returncode,
    }


TOKENIZER = ""


def main() -> None:
    global TOKENIZER
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups-per-step", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--offpolicy", type=int, default=4)
    parser.add_argument("--rows-in-flight", type=int, default=64, help="the gateway's --max-rows-in-flight")
    args = parser.parse_args()
    from fleetrl.tiny_model import build_tiny_model

    TOKENIZER = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="fleetrl-bench-tok-")) / "m"))
    t0 = time.monotonic()
    result = asyncio.run(run(args.groups_per_step, args.group_size, args.steps, args.offpolicy, args.rows_in_flight))
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
