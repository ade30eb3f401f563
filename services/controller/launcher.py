"""Launcher of the version controller:

    fleetrl serve controller --config run.toml [--rows rows.jsonl] [--trainer HOST:PORT]
        [--inference HOST:PORT ...] [--grpc-port 50051] [--metrics-port 9401] [--resume] [--set key=value ...]

Exits 0 when the data (or max_steps) is used up and the trainer has exported the final model; 1 on a run error,
including a run that trained nothing (the message says why; nothing is exported); 130 when stopped by SIGINT or
SIGTERM, after the step in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from fleetrl.shell.args import add_run_config_args, drop_unset, run_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl serve controller", description="Run the version controller.")
    add_run_config_args(parser)
    parser.add_argument("--rows", help="JSONL of rows (default: run.dataset)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port (default 50050, 0 = pick)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default 9401, 0 = pick)")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    parser.add_argument("--trainer", help="HOST:PORT of the trainer's control gRPC")
    parser.add_argument("--inference", action="append", default=[], help="HOST:PORT of an inference replica")
    parser.add_argument("--journal", help="SQLite journal path (default <log_path>/controller.sqlite)")
    parser.add_argument("--resume", action="store_true", help="resume from the journal")
    parser.add_argument(
        "--restart-weights",
        action="store_true",
        help="with --resume: if the trainer has no checkpoint, train the journal's trained rows again from the base "
        "model (default: fail)",
    )
    parser.add_argument("--lease-timeout", type=float, help="seconds before an unreported row is requeued")
    parser.add_argument("--heartbeat-timeout", type=float, help="seconds of silence before a member is dead")
    parser.add_argument(
        "--heartbeat-interval", type=float, help="seconds between member heartbeats and Status polls (default 2)"
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        help="seconds without a reported row or a step, or with the journal locked by another process: fail the run",
    )
    parser.add_argument(
        "--max-stale-attempts", type=int, help="times a row's group may come back stale before it is dropped"
    )
    parser.add_argument(
        "--trainer-patience", type=float, help="seconds to wait for a trainer that stopped answering (default 600)"
    )
    parser.add_argument("--metrics-linger", type=float, help="seconds /metrics stays up after the run (default 0)")
    parser.add_argument("--evaluation", action="store_true", help="an evaluator gateway runs: request evaluations")
    parser.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from fleetrl.config import ConfigError
    from fleetrl.services.controller.config import ControllerConfig

    try:
        values = drop_unset(
            {
                "run": run_config_from_args(args),
                "rows_path": args.rows,
                "host": args.host,
                "grpc_port": args.grpc_port,
                "metrics_port": args.metrics_port,
                "trainer_address": args.trainer,
                "inference_addresses": args.inference or None,
                "journal_path": args.journal,
                "resume": args.resume or None,
                "restart_weights": args.restart_weights or None,
                "lease_timeout_s": args.lease_timeout,
                "heartbeat_timeout_s": args.heartbeat_timeout,
                "heartbeat_interval_s": args.heartbeat_interval,
                "stall_timeout_s": args.stall_timeout,
                "trainer_patience_s": args.trainer_patience,
                "max_stale_attempts": args.max_stale_attempts,
                "metrics_linger_s": args.metrics_linger,
                "evaluation": args.evaluation or None,
                "ready_file": args.ready_file,
                "log_level": args.log_level,
            }
        )
        if args.no_metrics:
            values["metrics_port"] = None
        config = ControllerConfig.build(values)
    except (ConfigError, ValueError) as exc:
        print(f"fleetrl serve controller: {exc}", file=sys.stderr)
        return 2
    from fleetrl.services.controller.server import build_service
    from fleetrl.shell.service import ShellConfig, run_service
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="controller")
    return asyncio.run(run_service(build_service(config), ShellConfig.of(config)))


if __name__ == "__main__":
    sys.exit(main())
