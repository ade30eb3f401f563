"""The rollout gateway's command-line flags and the `GatewayConfig` they give: `fleetrl serve gateway`'s launcher
parses them, and so does `fleetrl.main()` (its in-process gateways take the same flags as gateway processes)."""

from __future__ import annotations

import argparse

from fleetrl.gateway.config import GatewayConfig
from fleetrl.shell.args import add_run_config_args, drop_unset, run_config_from_args


def build_parser() -> argparse.ArgumentParser:
    """The flags of `fleetrl serve gateway`."""
    parser = argparse.ArgumentParser(prog="fleetrl serve gateway", description="Run rollouts for the controller.")
    add_run_config_args(parser)
    parser.add_argument("--rollout", required=True, help="rollout factory: module:attr or path/file.py:attr")
    parser.add_argument("--dynamic-filter", help="'uniform' (drop equal-reward groups) or module:fn")
    parser.add_argument("--evaluation", help="evaluation hook module:fn (async fn(setup, rows) -> dict)")
    parser.add_argument("--controller", help="HOST:PORT of the controller (default 127.0.0.1:50050)")
    parser.add_argument(
        "--controller-ready-file", help="read the controller's address from its ready file (waits for it)"
    )
    parser.add_argument("--controller-ready-timeout", type=float, help="seconds to wait for that file (600)")
    parser.add_argument("--gateway-id", help="unique id (default gateway-<host>-<pid>)")
    parser.add_argument("--judge", action="append", help="HOST:PORT of a judge replica (repeat for each)")
    parser.add_argument("--judge-base-url", help="the judge pool's OpenAI base URL (http://host:port/v1)")
    parser.add_argument("--judge-model", help="the judge's model path (its tokenizer), with --judge")
    parser.add_argument(
        "--judge-resolve-s",
        type=float,
        help="each --judge names a DNS name with one address per judge replica, looked up every this many seconds",
    )
    parser.add_argument("--max-rows-in-flight", type=int, help="rows processed at once")
    parser.add_argument(
        "--rollout-timeout", type=float, help="seconds before a whole rollout is cancelled and dropped (default 600)"
    )
    parser.add_argument("--generate-timeout", type=float, help="seconds per Generate call, then retried (default 120)")
    parser.add_argument(
        "--replica-wait", type=float, help="seconds a Generate call waits for a routable replica (default 300)"
    )
    parser.add_argument("--breaker-window", type=int, help="circuit breaker: rollouts judged (default 100)")
    parser.add_argument("--breaker-min-attempts", type=int, help="circuit breaker: outcomes needed (default 20)")
    parser.add_argument(
        "--breaker-max-failure-rate", type=float, help="circuit breaker: failed share that stops it (default 0.5)"
    )
    parser.add_argument(
        "--max-group-mb", type=int, help="the trainer's max_group_mb: larger groups are rejected here (default 32)"
    )
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (0 = pick; default off)")
    parser.add_argument("--host", help="address the metrics endpoint binds to (default 127.0.0.1)")
    parser.add_argument("--metrics-linger", type=float, help="seconds /metrics stays up after the run (default 0)")
    parser.add_argument("--ready-file", help="write the metrics port here once running")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` of parsed gateway flags (ConfigError or ValueError names a bad one)."""
    return GatewayConfig.build(
        drop_unset(
            {
                "run": run_config_from_args(args),
                "rollout": args.rollout,
                "dynamic_filter": args.dynamic_filter,
                "evaluation": args.evaluation,
                "controller_address": args.controller,
                "controller_ready_file": args.controller_ready_file,
                "controller_ready_timeout_s": args.controller_ready_timeout,
                "gateway_id": args.gateway_id,
                "judge": args.judge,
                "judge_base_url": args.judge_base_url,
                "judge_model": args.judge_model,
                "judge_resolve_s": args.judge_resolve_s,
                "max_rows_in_flight": args.max_rows_in_flight,
                "rollout_timeout_s": args.rollout_timeout,
                "generate_timeout_s": args.generate_timeout,
                "replica_wait_s": args.replica_wait,
                "breaker_window": args.breaker_window,
                "breaker_min_attempts": args.breaker_min_attempts,
                "breaker_max_failure_rate": args.breaker_max_failure_rate,
                "max_group_mb": args.max_group_mb,
                "metrics_port": args.metrics_port,
                "metrics_linger_s": args.metrics_linger,
                "host": args.host,
                "ready_file": args.ready_file,
                "log_level": args.log_level,
            }
        )
    )
