"""Launcher of a rollout gateway (run as many as you like):

    fleetrl serve gateway --config run.toml --rollout my_rollout:make_rollout_fn [--controller HOST:PORT]
        [--dynamic-filter uniform|module:fn] [--metrics-port 0] [--set key=value ...]

Exit codes: 0 when the run is finished, 3 when the circuit breaker opened (the rollout function keeps failing),
4 when the user's code cannot be loaded, 2 on a bad flag or config, 1 on any other error. The flags are the
library's (fleetrl.gateway.flags: `fleetrl.main()` takes the same); the service is services/gateway/server.py.
"""

from __future__ import annotations

import sys

from fleetrl.gateway.flags import build_parser, config_from_args

__all__ = ["build_parser", "config_from_args", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from fleetrl.config import ConfigError

    try:
        config = config_from_args(args)
    except (ConfigError, ValueError) as exc:
        print(f"fleetrl serve gateway: {exc}", file=sys.stderr)
        return 2
    import asyncio

    from fleetrl.services.gateway.server import serve
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="gateway")
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
