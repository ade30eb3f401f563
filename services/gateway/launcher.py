"""Launcher of a rollout gateway (run as many as you like):

    fleetrl serve gateway --config run.toml --rollout my_rollout:make_rollout_fn [--controller HOST:PORT]
        [--dynamic-filter uniform|module:fn] [--metrics-port 0] [--set key=value ...]

Exit codes: 0 when the run is finished, 3 when the circuit breaker opened (the rollout function keeps failing),
1 on any other error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from fleetrl.exit_codes import EXIT_USER_CODE
from fleetrl.shell.args import add_run_config_args, drop_unset, run_config_from_args

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl serve gateway", description="Run rollouts for the controller.")
    add_run_config_args(parser)
    parser.add_argument("--rollout", required=True, help="rollout factory: module:attr or path/file.py:attr")
    parser.add_argument("--dynamic-filter", help="'uniform' (drop equal-reward groups) or module:fn")
    parser.add_argument("--evaluation", help="evaluation hook module:fn (async fn(setup, rows) -> dict)")
    parser.add_argument("--controller", help="HOST:PORT of the controller (default 127.0.0.1:50050)")
    parser.add_argument("--gateway-id", help="unique id (default gateway-<host>-<pid>)")
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
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (0 = pick; default off)")
    parser.add_argument("--host", help="address the metrics endpoint binds to (default 127.0.0.1)")
    parser.add_argument("--metrics-linger", type=float, help="seconds /metrics stays up after the run (default 0)")
    parser.add_argument("--ready-file", help="write the metrics port here once running")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return parser


def load_dynamic_filter(spec: str | None):  # type: ignore[no-untyped-def]
    from fleetrl.gateway.groups import drop_uniform_rewards
    from fleetrl.user_code import load_object

    if spec is None:
        return None
    return drop_uniform_rewards if spec == "uniform" else load_object(spec)


def config_from_args(args: argparse.Namespace) -> Any:
    """The `GatewayConfig` of parsed gateway flags (ConfigError or ValueError names a bad one)."""
    from fleetrl.services.gateway.config import GatewayConfig

    return GatewayConfig.build(
        drop_unset(
            {
                "run": run_config_from_args(args),
                "rollout": args.rollout,
                "dynamic_filter": args.dynamic_filter,
                "evaluation": args.evaluation,
                "controller_address": args.controller,
                "gateway_id": args.gateway_id,
                "max_rows_in_flight": args.max_rows_in_flight,
                "rollout_timeout_s": args.rollout_timeout,
                "generate_timeout_s": args.generate_timeout,
                "replica_wait_s": args.replica_wait,
                "breaker_window": args.breaker_window,
                "breaker_min_attempts": args.breaker_min_attempts,
                "breaker_max_failure_rate": args.breaker_max_failure_rate,
                "metrics_port": args.metrics_port,
                "metrics_linger_s": args.metrics_linger,
                "host": args.host,
                "ready_file": args.ready_file,
                "log_level": args.log_level,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from fleetrl.config import ConfigError

    try:
        config = config_from_args(args)
    except (ConfigError, ValueError) as exc:
        print(f"fleetrl serve gateway: {exc}", file=sys.stderr)
        return 2
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="gateway")
    return asyncio.run(run(config))


def model_vocab_size(run_cfg: Any, tokenizer: Any) -> int | None:
    """The policy's embedding rows (config.json's vocab_size; the tokenizer's length if there is no config): the
    bound every sample's token ids must stay under."""
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(run_cfg.base_model).vocab_size)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warning("no model config at %s (%s); token ids are checked against the tokenizer", run_cfg.base_model, exc)
        return len(tokenizer) if tokenizer is not None else None


async def run(  # type: ignore[no-untyped-def]
    config, rollout_factory=None, tokenizer=None, *, dynamic_filter=None, evaluation_fn=None
) -> int:
    """Run one gateway; the rollout factory, tokenizer, dynamic filter and evaluation hook may be given as objects
    (fleetrl.main's in-process gateways do: fleetrl.up.inprocess_gateway); else they are loaded from the config."""
    from transformers import AutoTokenizer

    from fleetrl.model_path import check_model_path
    from fleetrl.ready_file import write_ready_file
    from fleetrl.services.gateway.metrics import GatewayMetrics
    from fleetrl.services.gateway.worker import Gateway
    from fleetrl.telemetry import linger_then_close, start_metrics_server
    from fleetrl.user_code import load_object

    run_cfg = config.run
    if tokenizer is None:
        check_model_path(run_cfg.tokenizer_model or run_cfg.base_model)
        tokenizer = AutoTokenizer.from_pretrained(run_cfg.tokenizer_model or run_cfg.base_model)
    try:
        factory = rollout_factory or load_object(config.rollout)
        if evaluation_fn is None and config.evaluation:
            evaluation_fn = load_object(config.evaluation)
        if dynamic_filter is None:
            dynamic_filter = load_dynamic_filter(config.dynamic_filter)
    except Exception as exc:  # deterministic: restarting the gateway cannot fix the user's code
        log.error("cannot load the user's code: %s: %s", type(exc).__name__, exc)
        return EXIT_USER_CODE
    gateway = Gateway(config, factory, tokenizer, dynamic_filter, evaluation_fn, model_vocab_size(run_cfg, tokenizer))
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = start_metrics_server(config.metrics_port, host=config.host)
        GatewayMetrics(metrics_server.registry, gateway)
    if config.ready_file:
        write_ready_file(config.ready_file, {"metrics_port": metrics_server.port if metrics_server else None})
    code = 1
    try:
        code = await gateway.run()
        return code
    finally:
        await linger_then_close(metrics_server, config.metrics_linger_s if code == 0 else 0.0)


if __name__ == "__main__":
    sys.exit(main())
