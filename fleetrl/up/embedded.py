"""`fleetrl.main(cfg, rollout_fn_factory=..., rows=...)`: the Fireworks-cookbook entry point, run with `fleetrl up`.

    from fleetrl import Config, main
    if __name__ == "__main__":      # required: services start as child processes
        main(Config(base_model="./tiny", ...), rollout_fn_factory=make_rollout_fn, rows=rows)

The gateways run in this process (fleetrl.up.inprocess_gateway: asyncio tasks in a background thread, the same
Gateway and wire protocol as `fleetrl serve gateway`), so the rollout factory, `dynamic_filter_fn` and
`evaluation_fn` may be any callable (a lambda, a closure, a function of `__main__`); a string is a module:attr spec.
Controller, trainer, replicas and reference are child processes. Rows, if given, are written to
`<log_path>/rows.jsonl`. Pass `controller_address=` to attach to a running run, `resume=True` to continue a
stopped one (`restart_weights=True` as `fleetrl up --resume --restart-weights`), and `overwrite=True` to start over
in a log_path that holds a run (without it, such a log_path is refused). Keyword arguments that are `Config` fields
(`rollout_extras=...`, `max_steps=...`) update `cfg`; the others are `fleetrl up` options (the [up] table:
`engine=`, `gateways=`, ...).

Returns a summary dict (`run_summary`): `exit_code` (0; 1 when the run failed, a run that trains nothing failing and
saying why; 2 for a bad config or log_path; 130 when stopped by Ctrl-C or SIGTERM, the trainer checkpointing the
last step so `resume=True` continues), `steps`, `final_version`, `last_metrics`, `log_path`, `metrics_path`,
`final_model` (None when nothing was exported), `rows_dropped_slow` and `rows_dropped_failing` (rows the run left
out: too slow for the off-policy bound on every attempt, or failing every attempt; the exit code stays 0). A
script ends with `sys.exit(main(...)["exit_code"])`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError
from fleetrl.up.config import UpConfig
from fleetrl.up.inprocess_gateway import UserObjects


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
    """Run the whole training: the gateways in this process, every other service as a local process; returns
    `run_summary` (exit_code 0 = success). `evaluation_fn` (or `evaluation`) is the evaluation hook, a callable or
    a module:fn spec. `resume=True` continues the run in `cfg.log_path` (as `fleetrl up --resume`); `overwrite=True`
    deletes a run found there first (as `fleetrl up --overwrite`)."""
    from fleetrl.model_path import ModelNotFoundError, check_model_path
    from fleetrl.up.log_dir import LogDirError
    from fleetrl.up.run import check_log_dir
    from fleetrl.up.start_checks import check_inputs

    run_options = {k: v for k, v in options.items() if k in Config.model_fields}
    cookbook_up = cfg.cookbook_up_options  # DeployConfig.replica_count; main()'s own keyword arguments win
    up_options = {k: v for k, v in options.items() if k not in run_options}
    # The gateways run in this process: any callable works (a lambda, a closure, a function of __main__ or a
    # notebook); run_config.json records a label for each object, a string is a module:attr spec as in [up].
    evaluation_fn = up_options.pop("evaluation_fn", None)
    if evaluation_fn is None and callable(up_options.get("evaluation")):
        evaluation_fn = up_options.pop("evaluation")
    objects = UserObjects(
        None if isinstance(rollout_fn_factory, str) else rollout_fn_factory,
        None if isinstance(dynamic_filter_fn, str) else dynamic_filter_fn,
        None if isinstance(evaluation_fn, str) else evaluation_fn,
    )
    if isinstance(evaluation_fn, str):
        up_options["evaluation"] = evaluation_fn
    elif evaluation_fn is not None:
        up_options["evaluation"] = object_label(evaluation_fn)
    try:
        if run_options:
            cfg = Config.load({**cfg.model_dump(exclude_unset=True), **run_options}, source="fleetrl.main")
        if objects.evaluation_fn is not None and evaluation_needs_rows(objects.evaluation_fn) and not cfg.eval_dataset:
            raise ConfigError("evaluation_fn: name the held-out rows it evaluates: Config(eval_dataset=...)")
        rollout = rollout_fn_factory if isinstance(rollout_fn_factory, str) else object_label(rollout_fn_factory)
        up_data: dict[str, Any] = {"rollout": rollout, **cookbook_up, **up_options}
        up = main_options(up_data)
        check_model_path(cfg.base_model or "", "base_model")  # "no model at PATH" now, not a service's hub error
        check_inputs(cfg, up, Path.cwd(), rollout_fn_factory)  # teacher, judge, loss, environment (start_checks)
        # Before anything is written: a refused log_path keeps the rows and config of the run it holds.
        lock = check_log_dir(cfg, up, resume=resume, overwrite=overwrite)
    except (LogDirError, ModelNotFoundError, ConfigError) as exc:
        print(f"fleetrl.main: {exc}", file=sys.stderr)
        return run_summary(cfg, 2)
    try:  # log_path is this run's until it ends (a second run there is refused, naming this process)
        return _launch(cfg, up_data, rows, dynamic_filter_fn, objects, resume, restart_weights, lock)
    finally:
        if lock is not None:
            lock.release()


def evaluation_needs_rows(evaluation_fn: Any) -> bool:
    """Whether the hook is fleetrl's `(setup, rows)` shape (it evaluates run.eval_dataset's rows); the current
    cookbook's `(step, rollout_fn)` owns its rows. `ConfigError` naming evaluation_fn when its shape is unclear."""
    from fleetrl.rollout import evaluation_call_shape

    try:
        return evaluation_call_shape(evaluation_fn) == "setup_rows"
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _launch(
    cfg: Config,
    up_data: dict[str, Any],
    rows: Iterable[dict[str, Any]] | None,
    dynamic_filter_fn: Any,
    objects: UserObjects,
    resume: bool,
    restart_weights: bool,
    lock: Any,
) -> dict[str, Any]:
    from fleetrl.up.run import launch

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
            dynamic_filter_fn if isinstance(dynamic_filter_fn, str) else object_label(dynamic_filter_fn)
        )
    config_path = log_dir / "run_config.json"
    config_path.write_text(json.dumps({"run": run_data, "up": up_data}, indent=2))
    run = Config.from_toml(config_path)
    up = UpConfig.from_file(config_path)
    code = launch(config_path, [], run, up, resume=resume, restart_weights=restart_weights, objects=objects, lock=lock)
    return run_summary(run, code)


def object_label(obj: Any) -> str:
    """What run_config.json records for a Python object given to `main()` (the object itself is used)."""
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"<object {getattr(obj, '__module__', '?')}.{name}>"


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
    from fleetrl.commands.status import read_end_record

    ended = read_end_record(log_dir) or {}
    return {
        "exit_code": exit_code,
        "steps": len({m["step"] for m in steps}),
        "final_version": last.get("version"),
        "last_metrics": last,
        "log_path": str(log_dir),
        "metrics_path": str(metrics_path),
        "final_model": str(final) if (final / "config.json").exists() else None,
        # Rows the run dropped as too slow (stale on every attempt) or failing every attempt: exit_code stays 0.
        "rows_dropped_slow": int(ended.get("rows_dropped_slow") or 0),
        "rows_dropped_failing": int(ended.get("rows_dropped_failing") or 0),
    }
