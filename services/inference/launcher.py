"""Launcher of the inference server:

    fleetrl serve inference --model PATH --engine vllm|hf --grpc-port 50051 --http-port 8000 \\
        --metrics-port 9400 [--config inference.toml] [--host 127.0.0.1] [--no-http] [--no-metrics] \\
        [--relay-port 0 | --no-relay] [--relay-timeout-s 30] \\
        [--controller HOST:PORT [--member-id ID]] [--max-lora-rank R] \\
        [--tool-call-parser hermes|none|...] [--no-auto-tool-choice] \\
        [--dtype D] [--max-model-len N] [--max-num-seqs N] [--kv-cache-gib G | --gpu-memory-utilization F] \\
        [--enforce-eager | --no-enforce-eager]

With --controller the replica joins that run once serving: it registers, heartbeats, and the controller brings it
to the run's current version before routing rollouts to it.

Flags override the config file. Heavy modules (torch, grpc, vLLM) are imported only after parsing, so
`--help` is fast. Binds 127.0.0.1 unless --host says otherwise. The service shell (fleetrl/shell) runs the server:
--ready-file gets host, grpc_port, http_port, metrics_port and relay_address (its weight relay, which re-serves
the versions loaded through it to peers: docs/weights.md) once every endpoint serves; SIGINT/SIGTERM stop it
(exit code 0).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fleetrl.shell.args import drop_unset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl serve inference",
        description="Serve a model over gRPC (fleetrl.v1.Inference) and an OpenAI-compatible HTTP API.",
    )
    parser.add_argument("--config", type=Path, help="TOML file (top-level keys or [inference])")
    parser.add_argument("--model", help="HF model directory")
    parser.add_argument("--engine", choices=["vllm", "hf"], help="inference engine (default vllm)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--advertise-host", help="host others reach this replica (gRPC, weight relay) at")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 50051, 0 = pick)")
    parser.add_argument("--http-port", type=int, help="OpenAI HTTP port (default 8000, 0 = pick)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default 9400, 0 = pick)")
    parser.add_argument("--relay-port", type=int, help="weight relay port (default 0 = pick)")
    parser.add_argument("--relay-timeout-s", type=float, help="a relayed load fails after this long without progress")
    parser.add_argument("--no-relay", action="store_true", help="serve no weight relay (relayed loads are refused)")
    parser.add_argument("--no-http", action="store_true", help="do not serve the OpenAI HTTP API")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    parser.add_argument("--served-model-name", help="model id in the OpenAI API")
    parser.add_argument(
        "--tool-call-parser", help="vLLM engine: tool parser for OpenAI tool calls (default hermes; 'none' = off)"
    )
    parser.add_argument(
        "--no-auto-tool-choice", action="store_true", help="vLLM engine: do not parse tool_choice='auto' requests"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-on-swap", choices=["recompute", "keep"], help="vLLM: the KV cache across a swap")
    parser.add_argument("--device", help="hf engine: cpu, cuda, cuda:1 (default: cuda when a GPU is visible)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences decoded together at most")
    parser.add_argument("--max-model-len", type=int, help="prompt + completion length limit")
    parser.add_argument("--tensor-parallel-size", type=int, help="vLLM tensor parallelism")
    parser.add_argument(
        "--kv-cache-gib", type=float, help="vLLM KV cache size per rank (GiB); default: from the GPU share, 1 on CPU"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, help="vLLM on GPU: share of GPU memory to use (default 0.9)"
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM: no torch.compile / CUDA graphs (default: eager on CPU, CUDA graphs on GPU)",
    )
    parser.add_argument("--seed", type=int, help="engine seed")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    parser.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    parser.add_argument("--controller", help="HOST:PORT of a run's controller: join that run once serving")
    parser.add_argument("--member-id", help="id to register with the controller under (default inference-<host>-<pid>)")
    parser.add_argument(
        "--max-lora-rank", type=int, help="serve LoRA adapter versions up to this rank (default 0: LoRA off)"
    )
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The InferenceConfig the flags (and --config file) describe."""
    from fleetrl.services.inference.config import InferenceConfig

    overrides = {
        "model": args.model,
        "engine": args.engine,
        "host": args.host,
        "advertise_host": args.advertise_host,
        "grpc_port": args.grpc_port,
        "http_port": args.http_port,
        "metrics_port": args.metrics_port,
        "relay_port": args.relay_port,
        "relay_timeout_s": args.relay_timeout_s,
        "served_model_name": args.served_model_name,
        "tool_call_parser": None if args.tool_call_parser in (None, "none") else args.tool_call_parser,
        "dtype": args.dtype,
        "device": args.device,
        "kv_on_swap": args.kv_on_swap,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "kv_cache_gib": args.kv_cache_gib,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "log_level": args.log_level,
        "ready_file": args.ready_file,
        "controller_address": args.controller,
        "member_id": args.member_id,
        "max_lora_rank": args.max_lora_rank,
    }
    overrides = drop_unset(overrides)
    if args.config is not None:
        config = InferenceConfig.from_toml(args.config, overrides)
    else:
        config = InferenceConfig.build(overrides)
    disabled = {}
    if args.no_http:
        disabled["http_port"] = None
    if args.no_metrics:
        disabled["metrics_port"] = None
    if args.no_relay:
        disabled["relay_port"] = None
    if args.tool_call_parser == "none":
        disabled["tool_call_parser"] = None
    if args.no_auto_tool_choice:
        disabled["enable_auto_tool_choice"] = False
    return config.model_copy(update=disabled) if disabled else config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.model is None and args.config is None:
        print("fleetrl serve inference: --model PATH (or --config FILE) is required", file=sys.stderr)
        return 2
    from fleetrl.gpu_layout import check_gpu_env

    try:
        check_gpu_env(os.environ)  # compose's FLEETRL_TRAINER_GPUS / FLEETRL_INFERENCE_GPUS
    except ValueError as exc:
        print(f"fleetrl serve inference: {exc}", file=sys.stderr)
        return 2
    from fleetrl.services.inference.config import InferenceConfigError

    try:
        config = config_from_args(args)
    except InferenceConfigError as exc:
        print(f"fleetrl serve inference: {exc}", file=sys.stderr)
        return 2
    if not (Path(config.model) / "config.json").is_file():
        print(
            f"fleetrl serve inference: model: {config.model} is not a model directory (no config.json)",
            file=sys.stderr,
        )
        return 2

    import asyncio

    from fleetrl.services.inference.server import serve
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="inference")
    try:
        return asyncio.run(serve(config))
    except OSError as exc:  # the gRPC port in use, most often: say which, without a traceback
        print(f"fleetrl serve inference: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # vLLM's engine spawns processes: keep the guard
    sys.exit(main())
