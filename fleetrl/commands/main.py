"""The `fleetrl` command.

    fleetrl up run.toml [--set k=v]     run every service locally and train (the embedded default);
                                        --resume continues a stopped run, --overwrite starts over
    fleetrl serve <service> [options]   start one service (inference, trainer, reference, controller, gateway)
    fleetrl eval run.toml [--model P]   the run's evaluation hook on its held-out rows, for one model
    fleetrl status [--log-path P]       a running run's state (found from the ready files in P, default .)
    fleetrl health HOST:PORT            gRPC health probe (containers' HEALTHCHECK)
    fleetrl plot RUN [RUN ...]          PNG of the per-step metrics, one subplot each; runs compared
    fleetrl demo                        the foundation's pure logic learning a toy task (no services)
    fleetrl sft sft.toml [--set k=v]    supervised fine-tuning on prompt/completion or chat rows (one process)
    fleetrl --version

Heavy modules are imported only once a subcommand is chosen, so `fleetrl --help` is fast. A bad config, a bad
flag value or a missing model is one clean line per field (exit 2), never a traceback. The services are found
through package entry points (fleetrl/commands/registry.py), so `fleetrl serve NAME` starts any installed service.
`python -m fleetrl ...` runs this command too (fleetrl/__main__.py).
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from fleetrl import __version__
from fleetrl.commands.registry import UnknownServiceError, launcher_main, service_names
from fleetrl.config import ConfigError, format_validation_error
from fleetrl.model_path import ModelNotFoundError

COMMANDS = {
    "up": "train: every service as a local process (run.toml)",
    "serve": "start one service (fleetrl serve --help lists them)",
    "eval": "run the evaluation hook on held-out rows for a model",
    "status": "a running run's trainer version, steps, rows, services",
    "plot": "per-step metrics against step; compares runs",
    "health": "gRPC health probe of one service (HEALTHCHECK)",
    "demo": "the pure logic learning a toy task (no services)",
    "sft": "supervised fine-tuning on prompt/completion or chat rows",
}

# One help line per service this package installs; `fleetrl serve` starts whichever has an entry point.
SERVICES = {
    "inference": "an inference replica: generates with per-token logprobs, loads pushed weights (hf or vllm)",
    "trainer": "the policy trainer: trains on rollout groups, publishes weights, checkpoints",
    "reference": "the frozen reference policy: logprobs for the KL penalty (kl_beta > 0)",
    "controller": "the run's coordinator: leases rows, gates off-policy versions, steps the trainer",
    "gateway": "a rollout gateway: runs the user's rollout function against the replicas",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl",
        description="fleetrl: asynchronous RL for language models, built as services.",
        epilog="`fleetrl COMMAND --help` describes a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"fleetrl {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, line in COMMANDS.items():
        commands.add_parser(name, help=line, add_help=False)
    return parser


def serve_help() -> str:
    installed = service_names()
    names = [name for name in SERVICES if name in installed] + [n for n in installed if n not in SERVICES]
    width = max(map(len, names), default=0)
    lines = [f"  {name:<{width}}  {SERVICES.get(name, '')}".rstrip() for name in names]
    return "\n".join(
        [
            "usage: fleetrl serve SERVICE [options]",
            "",
            "Start one fleetrl service (`fleetrl serve SERVICE --help` lists its flags).",
            "",
            "services:",
            *(lines or ["  (none installed: `pip install -e .` declares them as entry points)"]),
        ]
    )


def _serve(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(serve_help())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        launcher = launcher_main(name)
    except UnknownServiceError as exc:
        print(f"fleetrl serve: {exc}", file=sys.stderr)
        return 2
    return int(launcher(rest) or 0)


def _run(command: str, rest: list[str]) -> int:
    if command == "serve":
        return _serve(rest)
    if command == "up":
        from fleetrl.up.run import main as up_main

        return up_main(rest)
    if command == "eval":
        from fleetrl.commands.evaluate import main as eval_main

        return eval_main(rest)
    if command == "status":
        from fleetrl.commands.status import main as status_main

        return status_main(rest)
    if command == "plot":
        from fleetrl.commands.plot import main as plot_main

        return plot_main(rest)
    if command == "health":
        from fleetrl.commands.health import main as health_main

        return health_main(rest)
    if command == "sft":
        from fleetrl.commands.sft import main as sft_main

        return sft_main(rest)
    from fleetrl.commands.demo import main as demo_main

    return int(demo_main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # --version, or the usage error for an unknown command (exits)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        return _run(command, rest)
    except (ConfigError, ModelNotFoundError) as exc:
        prefix = f"fleetrl {command}"
        print(str(exc) if str(exc).startswith(prefix) else f"{prefix}: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:  # a service or library config validated outside Config.load
        print(format_validation_error(exc, f"fleetrl {command}"), file=sys.stderr)
        return 2


def entry() -> None:
    """The `fleetrl` console script: `main`, then for `fleetrl serve` an exit without the interpreter's teardown
    when nothing can be lost by it (fleetrl.commands.fast_exit)."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["serve"]:
        from fleetrl.commands.fast_exit import can_exit_fast, exit_fast

        if can_exit_fast():
            exit_fast(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
