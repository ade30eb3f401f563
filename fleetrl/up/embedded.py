"""`fleetrl.main(cfg, rollout_fn_factory=..., rows=...)`: the Fireworks-cookbook entry point, run with `fleetrl up`.

    from fleetrl import Config, main
    if __name__ == "__main__":      # required: services start as child processes
        main(Config(base_model="./tiny", ...), rollout_fn_factory=make_rollout_fn, rows=rows)

The factory must be importable by the gateways (a module-level function, in a module or in the script itself);
rows, if given, are written to `<log_path>/rows.jsonl`. Pass `controller_address=` to attach to a running run,
`resume=True` to continue a stopped one (`restart_weights=True` as `fleetrl up --resume --restart-weights`), and
`overwrite=True` to start over in a log_path that holds a run (without it, such a log_path is refused). Returns the
exit code: 0, 1 when the run failed (a run that trains nothing fails, saying why), 2 for a bad config or log_path,
130 when stopped by Ctrl-C or SIGTERM (the trainer checkpoints the last step: `resume=True` continues).
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
    **up_options: Any,
) -> int:
    """Run the whole training with every service as a local process; returns the exit code (0 = success).
    `resume=True` continues the run in `cfg.log_path` (as `fleetrl up --resume`); `overwrite=True` deletes a run
    found there first (as `fleetrl up --overwrite`)."""
    from fleetrl.up.log_dir import LogDirError
    from fleetrl.up.run import check_log_dir, launch

    up_data: dict[str, Any] = {"rollout": factory_spec(rollout_fn_factory), **up_options}
    try:
        # Before anything is written: a refused log_path keeps the rows and config of the run it holds.
        check_log_dir(cfg, UpConfig.from_dict(up_data, "fleetrl.main"), resume=resume, overwrite=overwrite)
    except LogDirError as exc:
        print(f"fleetrl.main: {exc}", file=sys.stderr)
        return 2
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
    return launch(config_path, [], run, up, resume=resume, restart_weights=restart_weights)
