"""The `fleetrl` command.

    fleetrl up run.toml [--set k=v]     run every service locally and train (the embedded default);
                                        --resume continues a stopped run, --overwrite starts over
    fleetrl serve <service> [options]   start one service (inference, trainer, reference, controller, gateway)
    fleetrl eval run.toml [--model P]   the run's evaluation hook on its held-out rows, for one model
    fleetrl status [HOST:PORT]          print a running controller's state
    fleetrl health HOST:PORT            gRPC health probe (containers' HEALTHCHECK)
    fleetrl plot LOG_PATH               PNG of reward, eval accuracy, KL, entropy and version offset per step
    fleetrl demo                        the foundation's pure logic learning a toy task (no services)

Heavy modules are imported only once a subcommand is chosen, so `fleetrl --help` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SERVICES = ("inference", "trainer", "reference", "controller", "gateway")


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fleetrl serve {" + ",".join(SERVICES) + "} [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SERVICES:
        print(f"fleetrl serve: unknown service {name!r}; choose one of {', '.join(SERVICES)}")
        return 2
    launcher = importlib.import_module(f"fleetrl.services.{name}.launcher")
    return int(launcher.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fleetrl", description=__doc__.split("\n\n")[0])
    commands = ["up", "serve", "eval", "status", "plot", "health", "demo"]
    parser.add_argument("command", choices=commands, help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return _serve(rest)
    if command == "up":
        from fleetrl.up.run import main as up_main

        return up_main(rest)
    if command == "eval":
        from fleetrl.up.evaluate import main as eval_main

        return eval_main(rest)
    if command == "status":
        from fleetrl.up.status import main as status_main

        return status_main(rest)
    if command == "plot":
        from fleetrl.plot import main as plot_main

        return plot_main(rest)
    if command == "health":
        from fleetrl.health_probe import main as health_main

        return health_main(rest)
    if command == "demo":
        from fleetrl.demo import main as demo_main

        return int(demo_main(rest) or 0)
    parser.parse_args(argv)  # prints the usage error for an unknown command
    return 2


if __name__ == "__main__":
    sys.exit(main())
