"""`fleetrl.main(cfg, rollout_fn_factory=..., rows=...)`: the Fireworks-cookbook entry point, run with `fleetrl up`.

    from fleetrl import Config, main
    if __name__ == "__main__":      # required: services start as child processes
        main(Config(base_model="./tiny", ...), rollout_fn_factory=make_rollout_fn, rows=rows)

The factory must be importable by the gateways (a module-level function, in a module or in the script itself);
rows, if given, are written to `<log_path>/rows.jsonl`. Pass `controller_address=` to attach to a running run,
`resume=True` to continue a stopped one (`restart_weights=True` as `fleetrl up --resume --restart-weights`), and
`overwrite=True` to start over in a log_path that holds a run (without it, such a log_path is refused). Keyword
arguments that are `Config` fields (`rollout_extras=...`, `max_steps=...`) update `cfg`; the others are `fleetrl up`
options (the [up] table: `engine=`, `gateways=`, ...).

Returns a summary dict (`run_summary`): `exit_code` (0; 1 when the run failed, a run that trains nothing failing and
saying why; 2 for a bad config or log_path; 130 when stopped by Ctrl-C or SIGTERM, the trainer checkpointing the
last step so `resume=True` continues), `steps`, `final_version`, `last_metrics`, `log_path`, `metrics_path`,
`final_model` (None when nothing was exported). A script ends with `sys.exit(main(...)["exit_code"])`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError
from fleetrl.up.config import UpConfig


def factory_spec(factory: Any) -> str:
    """'module:attr' (or 'script.py:attr' for the __main__ script) naming a module-level callable."""
    if isinstance(factory, str):
        return factory
    qualname = getattr(factory, "__qualname__", "")
    module = getattr(factory, "__module__", None)
    if not qualname or "<" in qualname or "." in qualname or module is None:
        raise ConfigError(
            f"rollout_fn_factory {factory!r} must be a module-level function (not a lambda, closure or method) so "
            "the gateway processes can import it"
        )
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if script is None:
            raise ConfigError("rollout_fn_factory is defined in an interactive session; put it in a file")
        return f"{Path(script).resolve()}:{qualname}"
    # A module imported from next to the script (`from rollout import make_rollout_fn`) is importable only from
    # that folder: name it by its file so the gateways find it from any working directory.
    module_file = getattr(sys.modules.get(module), "__file__", None)
    script = getattr(sys.modules["__main__"], "__file__", None)
    if module_file and script and Path(module_file).resolve().parent == Path(script).resolve().parent:
        return f"{Path(module_file).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def main(
    cfg: Config,
    rollout_fn_factory: Any,
    rows: Iterable[dict[str, Any]] | None = None,
    *,
    dynamic_filter_fn: Any = None,
    resume: bool = False,
    restart_weights: bool = False,
    overwrite: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Run the whole training with every service as a local process; returns `run_summary` (exit_code 0 =
    success). `resume=True` continues the run in `cfg.log_path` (as `fleetrl up --resume`); `overwrite=True`
    deletes a run found there first (as `fleetrl up --overwrite`)."""
    from fleetrl.model_path import ModelNotFoundError, check_model_path
    from fleetrl.up.log_dir import LogDirError
    from fleetrl.up.run import check_log_dir, launch

    run_options = {k: v for k, v in options.items() if k in Config.model_fields}
    up_options = {k: v for k, v in options.items() if k not in run_options}
    try:
        if run_options:
            cfg = Config.load({**cfg.model_dump(exclude_unset=True), **run_options}, source="fleetrl.main")
        up_data: dict[str, Any] = {"rollout": factory_spec(rollout_fn_factory), **up_options}
        up = main_options(up_data)
        check_model_path(cfg.base_model or "", "base_model")  # "no model at PATH" now, not a service's hub error
        # Before anything is written: a refused log_path keeps the rows and config of the run it holds.
        check_log_dir(cfg, up, resume=resume, overwrite=overwrite)
    except (LogDirError, ModelNotFoundError, ConfigError) as exc:
        print(f"fleetrl.main: {exc}", file=sys.stderr)
        return run_summary(cfg, 2)
    log_dir = Path(cfg.log_path)
    log_dir.mkdir(parents=True, exist_ok=True)
    run_data = cfg.model_dump(mode="json", exclude_none=False)
    if rows is not None:
        rows_path = log_dir / "rows.jsonl"
        with open(rows_path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        run_data["dataset"] = str(rows_path)
    if dynamic_filter_fn is not None:
        up_data["dynamic_filter"] = (
            dynamic_filter_fn if isinstance(dynamic_filter_fn, str) else factory_spec(dynamic_filter_fn)
        )
    config_path = log_dir / "run_config.json"
    config_path.write_text(json.dumps({"run": run_data, "up": up_data}, indent=2))
    run = Config.from_toml(config_path)
    up = UpConfig.from_file(config_path)
    return run_summary(run, launch(config_path, [], run, up, resume=resume, restart_weights=restart_weights))


def main_options(up_data: dict[str, Any]) -> UpConfig:
    """The `fleetrl up` options given to `main()` as keyword arguments; a bad one is named as the keyword argument
    it is, not as a field of an [up] table the caller never wrote."""
    try:
        return UpConfig.from_dict(up_data, "fleetrl.main")
    except ConfigError as exc:
        text = str(exc).replace("invalid [up] table", "invalid keyword arguments", 1).replace("  up.", "  ")
        raise ConfigError(text) from None


def run_summary(cfg: Config, exit_code: int) -> dict[str, Any]:
    """What `main()` returns: the exit code, the steps trained, the final policy version, the last step's metrics
    and where the run's files are."""
    log_dir = Path(cfg.log_path)
    metrics_path = log_dir / "metrics.jsonl"
    steps: list[dict[str, Any]] = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed trainer
            if isinstance(record, dict) and "step" in record and "data/samples" in record:
                steps.append(record)
    final = Path(cfg.output_dir) if cfg.output_dir else log_dir / "final"
    last = steps[-1] if steps else {}
    return {
        "exit_code": exit_code,
        "steps": len({m["step"] for m in steps}),
        "final_version": last.get("version"),
        "last_metrics": last,
        "log_path": str(log_dir),
        "metrics_path": str(metrics_path),
        "final_model": str(final) if (final / "config.json").exists() else None,
    }
