"""`fleetrl sft CONFIG`: supervised fine-tuning of `[run] base_model` on `[sft] dataset` with the RL trainer.

    fleetrl sft examples/arithmetic/sft.toml
    fleetrl sft sft.toml --set max_steps=100 --set sft.batch_size=32
    fleetrl sft sft.toml --resume                      # from the latest checkpoint under log_path/checkpoints
    torchrun --nproc-per-node 2 -m fleetrl sft sft.toml   # FSDP2 over the ranks (rank 0 logs and exports)

CONFIG is TOML: the `[run]` table holds the trainer's settings (the fields of `fleetrl.Config`: base_model, log_path,
output_dir, learning_rate, lr_schedule, max_steps, seed, lora_rank, dtype, packing, max_seq_len, loggers, ...), the
`[sft]` table the rows and batch (`fleetrl.trainer.sft.SFTSettings`). Rows, drops and the loss as in
fleetrl.trainer.sft. Metrics go to the run's trackers (`loggers`; log_path/metrics.jsonl always), the
final checkpoint under log_path/checkpoints, the HF model in output_dir (default log_path/final). Exit 0; 2 on a bad
config (naming the field) or a dataset with no trainable row; 1 when training fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from pydantic import ValidationError

from fleetrl.config import Config, ConfigError, format_validation_error, parse_override, read_config_file

TABLES = ("run", "sft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="TOML with [run] (trainer settings) and [sft] (dataset, batch_size, ...)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field: a [run] field by name, an [sft] one as sft.NAME (repeatable)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    parser.add_argument(
        "--verbose", action="store_true", help="the trainer's line per step too (else every log_interval steps)"
    )
    return parser


def load_config(path: str, overrides: list[str]) -> tuple[Config, Any]:
    """The run config and the SFT settings of `path` with `overrides`; ConfigError naming the field otherwise."""
    from fleetrl.trainer.sft import SFTSettings

    tables = read_config_file(path)
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {unknown}; fleetrl sft reads [run] and [sft]")
    run = dict(tables.get("run", {}))
    sft = dict(tables.get("sft", {}))
    run_keys, sft_keys = [], []
    for item in overrides:
        key, value = parse_override(item)
        if key.startswith("sft."):
            sft[key.removeprefix("sft.")] = value
            sft_keys.append(key.removeprefix("sft."))
        else:
            run[key] = value
            run_keys.append(key)
    cfg = Config.load(run, source=path, override_keys=run_keys)
    try:
        settings = SFTSettings(**sft)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, path, SFTSettings, sft_keys, prefix="sft.")) from None
    return cfg, settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, settings = load_config(args.config, args.set)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    trainer_log = logging.getLogger("fleetrl.trainer.policy_trainer")
    level = trainer_log.level
    if not args.verbose:  # a line per step is the RL trainer's habit; here the loss every log_interval steps says it
        trainer_log.setLevel(logging.WARNING)
    try:
        return _train(args, cfg, settings)
    finally:
        trainer_log.setLevel(level)


def _train(args: argparse.Namespace, cfg: Config, settings: Any) -> int:
    import torch

    from fleetrl.trackers.factory import make_trackers
    from fleetrl.trainer.sft import DROP_REASONS, run_sft

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if os.environ.get("RANK", "0") != "0":  # a torchrun follower: rank 0 logs, checkpoints and exports
        run_sft(cfg, settings, device=device, resume=args.resume)
        return 0
    trackers = make_trackers(cfg, resume=args.resume)
    failed = True
    try:
        trackers.log_config(cfg.model_dump(mode="json") | {"sft": settings.model_dump()})
        try:
            result = run_sft(cfg, settings, device=device, trackers=trackers, resume=args.resume)
        except (ValueError, FileNotFoundError) as exc:
            print(f"fleetrl sft: {exc}", file=sys.stderr)
            return 2
        failed = False
    finally:
        trackers.close(failed=failed)
    dropped = ", ".join(f"{result.dropped[r]} {r}" for r in DROP_REASONS if result.dropped.get(r)) or "none"
    tail = result.losses[-20:]
    final = f"{sum(tail) / len(tail):.4f}" if tail else "n/a (no step left to train)"
    print(
        f"fleetrl sft: {result.steps} steps on {result.examples} rows (dropped: {dropped}), final loss {final}, "
        f"{result.seconds:.0f} s -> {result.export}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
