"""Launcher of the policy trainer:

    fleetrl serve trainer --config run.toml [--set key=value ...] [--grpc-port 50071] [--groups-port 5571]
        [--weights-port 5572] [--metrics-port 9403] [--reference HOST:PORT|local] [--resume] [--auto-steps]
    fleetrl serve trainer --config run.toml --standalone groups.jsonl [--resume]      # no other service
    torchrun --nproc-per-node 2 -m fleetrl.services.trainer.launcher --config run.toml ...   # FSDP2

`--set` overrides run-config keys (TOML values: --set learning_rate=1e-4 --set policy_loss='"ppo"' or
--set policy_loss=ppo). `--model PATH` is a shortcut for --set base_model=PATH. In standalone mode with
kl_beta > 0 and no --reference, a frozen in-process copy of the base model serves the reference logprobs; with
LoRA (lora_rank > 0) the reference is always the base weights with the adapter disabled, and --reference is unused.
Heavy modules (torch, grpc, zmq) are imported after parsing, so --help is fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fleetrl.shell.args import add_run_config_args, drop_unset, run_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl serve trainer",
        description="Train the policy from rollout groups (ZeroMQ) under gRPC control, publishing weights.",
    )
    add_run_config_args(parser)
    parser.add_argument("--model", help="shortcut for --set base_model=PATH")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--advertise-host", help="host others reach the group/weight streams at (e.g. trainer)")
    parser.add_argument("--grpc-port", type=int, help="control gRPC port (default 50071, 0 = pick)")
    parser.add_argument("--groups-port", type=int, help="rollout-group PULL port (default 5571, 0 = pick)")
    parser.add_argument("--weights-port", type=int, help="weight stream port (default 5572, 0 = pick)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default 9403, 0 = pick)")
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    parser.add_argument("--reference", help="HOST:PORT of the reference service, or 'local'")
    parser.add_argument("--device", help="torch device (default cpu)")
    parser.add_argument(
        "--sharding", choices=("fsdp", "hsdp"), help="under torchrun: fsdp (default) or hsdp (replicate across nodes)"
    )
    parser.add_argument("--micro-batch-size", type=int, help="samples per forward/backward")
    parser.add_argument("--total-steps", type=int, help="run length in batches (LR decay)")
    parser.add_argument("--resume", action="store_true", help="restore the latest checkpoint first")
    parser.add_argument("--checkpoint-dir", help="default <log_path>/checkpoints")
    parser.add_argument("--output-dir", help="final HF export (default run.output_dir or <log_path>/final)")
    parser.add_argument("--standalone", metavar="GROUPS_JSONL", help="train from recorded groups, then exit")
    parser.add_argument("--auto-steps", action="store_true", help="train whenever P groups have arrived")
    parser.add_argument("--record-groups", metavar="JSONL", help="append every received group here")
    parser.add_argument("--group-wait-timeout", type=float, help="seconds TrainStep waits for groups")
    parser.add_argument(
        "--max-group-mb", type=int, help="largest rollout-group message accepted, MiB (32; the gateways' must match)"
    )
    parser.add_argument(
        "--stop-checkpoint-wait",
        type=float,
        help="at SIGINT/SIGTERM: seconds to wait for a step in flight before checkpointing the last step (120)",
    )
    parser.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return parser


def config_from_args(args: argparse.Namespace) -> Any:
    """The `TrainerServiceConfig` the flags describe (flags left unset take its defaults)."""
    from fleetrl.services.trainer.config import TrainerServiceConfig

    run = run_config_from_args(args, {"base_model": args.model} if args.model else None)
    reference = args.reference
    if reference is None and args.standalone and (run.kl_beta > 0 or run.teacher_model) and not run.lora:
        reference = "local"
    values = {
        "run": run,
        "host": args.host,
        "advertise_host": args.advertise_host,
        "grpc_port": args.grpc_port,
        "groups_port": args.groups_port,
        "weights_port": args.weights_port,
        "metrics_port": args.metrics_port,
        "reference": reference,
        "device": args.device,
        "max_group_mb": args.max_group_mb,
        "sharding": args.sharding,
        "micro_batch_size": args.micro_batch_size,
        "total_steps": args.total_steps,
        "resume": args.resume or None,
        "checkpoint_dir": args.checkpoint_dir,
        "output_dir": args.output_dir,
        "standalone": args.standalone,
        "auto_steps": args.auto_steps or None,
        "record_groups": args.record_groups,
        "group_wait_timeout_s": args.group_wait_timeout,
        "stop_checkpoint_wait_s": args.stop_checkpoint_wait,
        "ready_file": args.ready_file,
        "log_level": args.log_level,
    }
    values = drop_unset(values)
    if args.no_metrics:
        values["metrics_port"] = None
    return TrainerServiceConfig.build(values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.config is None and args.model is None and not any(s.startswith("base_model=") for s in args.set):
        print("fleetrl serve trainer: --config run.toml (or --model PATH) is required", file=sys.stderr)
        return 2
    from fleetrl.gpu_layout import check_gpu_env

    try:
        check_gpu_env(os.environ)  # compose's FLEETRL_TRAINER_GPUS / FLEETRL_INFERENCE_GPUS
    except ValueError as exc:
        print(f"fleetrl serve trainer: {exc}", file=sys.stderr)
        return 2
    from fleetrl.config import ConfigError
    from fleetrl.services.trainer.config import TrainerConfigError

    try:
        config = config_from_args(args)
    except (ConfigError, TrainerConfigError) as exc:
        print(f"fleetrl serve trainer: {exc}", file=sys.stderr)
        return 2

    from fleetrl.services.trainer.server import run
    from fleetrl.telemetry import setup_logging

    setup_logging(config.log_level, service="trainer")
    try:
        return run(config)
    except (OSError, ValueError) as exc:  # a port in use, a model that does not load: say so plainly
        import logging

        logging.getLogger("fleetrl.services.trainer").debug("trainer failed", exc_info=True)
        print(f"fleetrl serve trainer: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
