"""Command-line pieces every service launcher shares: the run config file and `--set key=value` overrides."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fleetrl.config import Config, parse_override


def add_run_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="run TOML (fleetrl.Config: top-level keys or [run])")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run key")


def run_config_from_args(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    """The run `Config` from --config and --set (`extra` overrides are applied before --set)."""
    overrides = dict(extra or {})
    overrides.update(parse_override(item) for item in args.set)
    if args.config:
        return Config.from_toml(args.config, overrides)
    return Config.load(overrides, source="--set")


def drop_unset(values: dict[str, Any]) -> dict[str, Any]:
    """Flags left at None fall back to the service config's defaults."""
    return {k: v for k, v in values.items() if v is not None}
