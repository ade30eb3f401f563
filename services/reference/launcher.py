"""Launcher of the reference trainer (forward-only, frozen base policy):

    fleetrl serve reference --model PATH [--student-model PATH] [--grpc-port 50061] [--metrics-port 9402]
        [--host 127.0.0.1] [--dtype float32|bfloat16] [--device cpu] [--max-batch-tokens N] [--ready-file PATH]

Not started at all when kl_beta = 0 and no teacher_model is set. Heavy modules are imported after parsing, so
--help is fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fleetrl.shell.args import drop_unset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl serve reference",
        description="Serve reference-policy logprobs over gRPC (fleetrl.v1.Reference/ComputeLogprobs).",
    )
    parser.add_argument("--model", required=True, help="HF causal LM path (the base policy, or a teacher)")
    parser.add_argument(
        "--student-model", help="with a distillation teacher as --model: the run's model, whose tokenizer must match"
    )
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 50061, 0 = pick)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default 9402, 0 = pick)")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--device", help="torch device (default cpu)")
    parser.add_argument("--max-batch-tokens", type=int, help="padded tokens per forward at most")
    parser.add_argument("--batch-wait-ms", type=float, help="wait for more requests to batch (ms)")
    parser.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The `ReferenceConfig` the flags describe (flags left unset take its defaults)."""
    from fleetrl.services.reference.config import ReferenceConfig

    values = drop_unset(
        {
            "model": args.model,
            "student_model": args.student_model,
            "host": args.host,
            "grpc_port": args.grpc_port,
            "metrics_port": args.metrics_port,
            "dtype": args.dtype,
            "device": args.device,
            "max_batch_tokens": args.max_batch_tokens,
            "batch_wait_ms": args.batch_wait_ms,
            "ready_file": args.ready_file,
            "log_level": args.log_level,
        }
    )
    if args.no_metrics:
        values["metrics_port"] = None
    return ReferenceConfig.build(values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from fleetrl.services.reference.config import ReferenceConfigError

    try:
        config = config_from_args(args)
    except ReferenceConfigError as exc:
        print(f"fleetrl serve reference: {exc}", file=sys.stderr)
        return 2

    import asyncio

    from fleetrl.services.reference.server import serve
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="reference")
    try:
        return asyncio.run(serve(config))
    except (OSError, ValueError) as exc:  # a port in use or a model that does not load: say so plainly
        print(f"fleetrl serve reference: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
