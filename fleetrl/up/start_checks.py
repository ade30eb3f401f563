"""`fleetrl up`'s start checks of what the services would otherwise find wrong only after they started: the judge's
and the teacher's model folders, a custom loss, the environment a run names, and the process environment the
services read. Each refuses with `ConfigError`, one line naming the field (or the environment variable) and what is
wrong, so `fleetrl up` exits 2 before any service starts (issue 45, item 7).

    check_model_folder(up.judge_model, "up.judge_model")
    check_custom_loss(run, config_dir)
    check_run_environment(run, config_dir)
    check_process_environment(os.environ, up.auth_token)
    check_weight_transport(run, up)

The dataset, the rollout and its hooks, the advantage estimator and the teacher's tokenizer are checked in
fleetrl.up.run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError
from fleetrl.model_path import adapter_instead_of_model, looks_like_path
from fleetrl.up.config import UpConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files a model folder holds its weights in (safetensors or PyTorch shards, their indexes end in .json)."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ENVIRONMENT_FIELD = "run.rollout_extras.environment"


def check_model_folder(name: str | None, field: str) -> None:
    """A model that a service other than the trainer loads (the judge's replicas, the teacher) is a model: a local
    folder holds a readable `config.json` and weights; a hub id that is not in the local cache is refused when the
    hub cannot be reached (HF_HUB_OFFLINE). A path with nothing there is said by fleetrl.model_path (checked
    first)."""
    if not name:
        return
    path = Path(name).expanduser()
    if not path.exists():
        if not looks_like_path(name):
            _check_hub_model(name, field)
        return
    if not path.is_dir():
        raise ConfigError(f"{field}: {name} is a file, not a model folder (config.json and weights)")
    if (adapter := adapter_instead_of_model(name)) is not None:
        raise ConfigError(f"{field}: {adapter.split(':')[0]}")
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(f"{field}: {name} holds no model (no config.json)")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: {config}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{field}: {config}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or not ("model_type" in data or "architectures" in data):
        raise ConfigError(f"{field}: {config}: not a model's config (no model_type or architectures)")
    weights = [p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_INDEXES]
    if not weights:
        raise ConfigError(
            f"{field}: {name} holds no weights (no {', '.join('*' + s for s in WEIGHT_SUFFIXES)} file): a model "
            "saved with save_pretrained has them"
        )


def _check_hub_model(name: str, field: str) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return  # reachable, as far as we know: the service downloads it
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    raise ConfigError(
        f"{field}: {name} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it first "
        "(huggingface-cli download) or name a local folder"
    )


@contextlib.contextmanager
def _user_import_path(config_dir: Path) -> Iterator[None]:
    """The config's folder and the working directory on the import path, as a service has them (its PYTHONPATH,
    `python -m` in fleetrl up's folder)."""
    added = [p for p in (str(config_dir.resolve()), os.getcwd()) if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for path in added:
            if path in sys.path:
                sys.path.remove(path)


def check_custom_loss(run: Config, config_dir: Path) -> None:
    """A custom `policy_loss` (an import path) imported and given its trial call here, as the trainer will when it
    starts (fleetrl.losses.custom.check_custom_loss): a module that cannot be imported, a missing attribute, a loss
    of the wrong shape, without gradient or not finite is refused naming `run.policy_loss`."""
    from fleetrl.losses import LOSS_NAMES

    if run.policy_loss in LOSS_NAMES:
        return
    from fleetrl.losses import resolve_loss_settings  # imports torch: only for a custom loss

    with _user_import_path(config_dir):
        try:
            resolve_loss_settings(run.policy_loss, run)
        except ValueError as exc:
            message = str(exc)
            raise ConfigError(message if message.startswith("run.") else f"run.{message}") from None


def check_run_environment(run: Config, config_dir: Path) -> None:
    """The environment a run names (`rollout_extras.environment`, fleetrl.environments: `verifiers:<taskset>` or
    `openenv:<client spec>`) loaded here with its options, as each gateway will, and it must have at least one task:
    a kind that does not exist, a taskset that cannot be imported or configured, a missing extra, or an empty
    taskset is refused naming the field."""
    extras = run.rollout_extras or {}
    spec = extras.get("environment")
    if spec is None:
        return
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{ENVIRONMENT_FIELD}: name the environment, e.g. 'verifiers:reverse_text', got {spec!r}")
    options = extras.get("environment_options")
    if options is not None and not isinstance(options, dict):
        raise ConfigError(
            f"run.rollout_extras.environment_options: a table of the environment's options, got {options!r}"
        )
    try:
        from fleetrl.environments import environment_rows
    except ImportError as exc:  # an install without environment support
        raise ConfigError(f"{ENVIRONMENT_FIELD}: this fleetrl has no environment support ({exc})") from None
    with _user_import_path(config_dir):
        try:
            rows = environment_rows(spec, options)
        except Exception as exc:  # the environment's own code: anything it raises is the run's bad setting
            text = str(exc).removeprefix("environment: ").removeprefix("environment ")
            raise ConfigError(f"{ENVIRONMENT_FIELD}: {type(exc).__name__}: {text}"[:500]) from None
    if not rows:
        raise ConfigError(f"{ENVIRONMENT_FIELD}: {spec!r} has no tasks (with environment_options {options or {}})")


def check_process_environment(environ: Mapping[str, str], auth_token: str | None = None) -> None:
    """The environment variables every service reads, checked once here instead of failing in each service as it
    starts: FLEETRL_LOG_LEVEL a logging level (every service's logging refuses another), the auth token (`[up]
    auth_token`, else FLEETRL_AUTH_TOKEN) something a gRPC header can carry (printable ASCII)."""
    level = environ.get("FLEETRL_LOG_LEVEL")
    if level is not None and level.upper() not in logging.getLevelNamesMapping():
        names = ", ".join(n for n in logging.getLevelNamesMapping() if n not in ("WARN", "FATAL", "NOTSET"))
        raise ConfigError(f"FLEETRL_LOG_LEVEL (environment) = {level!r}: not a log level; one of {names}")
    token, where = (auth_token, "up.auth_token") if auth_token else (environ.get("FLEETRL_AUTH_TOKEN"), None)
    if token and not all(32 <= ord(c) <= 126 for c in token):
        where = where or "FLEETRL_AUTH_TOKEN (environment)"
        raise ConfigError(
            f"{where}: the token has a control or a non-ASCII character, which a gRPC header cannot carry; "
            "use printable ASCII (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def check_inputs(run: Config, up: UpConfig, config_dir: Path, rollout_factory: Any = None) -> None:
    """Every check of this module, for a run `fleetrl.main()` starts (`fleetrl up` calls them one by one, in the
    order of its other checks): the environment variables, the rollout factory's signature (when it is a Python
    object), and, unless the run only attaches gateways to a running controller, the teacher's and the judge's
    folders and a custom loss; the run's environment always (the gateways load it)."""
    check_process_environment(os.environ, up.auth_token)
    check_weight_transport(run, up)
    if callable(rollout_factory):
        check_factory_signature("rollout_fn_factory", up.rollout, rollout_factory)
    if up.controller_address is None:
        check_model_folder(run.teacher_model, "teacher_model")
        check_model_folder(up.judge_model, "judge_model")
        check_custom_loss(run, config_dir)
    check_run_environment(run, config_dir)


def check_weight_transport(run: Config, up: UpConfig) -> None:
    """``run.weight_transport = "engine"`` (fleetrl.weights.engine_push) is built for vLLM replicas with the trainer
    and the replicas on the same kind of device: both on CPU (the "fleetrl_gloo" engine) or both on CUDA (vLLM's
    "nccl" engine; trainer_gpus and inference_gpus are disjoint, so never "ipc"); any trainer world size (rank 0
    sends its published snapshot, which the sharded publish gathered already) and tensor-parallel size (each TP
    worker is a rank of the group). LoRA and relayed fan-out are refused by the run config. One end on a GPU and the
    other not has no collective between them and is refused, naming the field, instead of silently loading over
    the weight stream."""
    if run.weight_transport != "engine":
        return
    if up.engine != "vllm":
        raise ConfigError(
            "run.weight_transport: 'engine' drives vLLM's weight-transfer engines and needs up.engine = 'vllm' (hf "
            "replicas load over the weight stream: weight_transport 'zmq')"
        )
    if up.trainer_on_cuda and up.inference_gpus is None:
        raise ConfigError(
            "up.inference_gpus: weight_transport 'engine' with the trainer on CUDA needs the replicas on GPUs too "
            "(vLLM's nccl engine links two GPUs; CPU replicas load over the weight stream: weight_transport 'zmq')"
        )
    if up.inference_gpus is not None and not up.trainer_on_cuda:
        raise ConfigError(
            "up.trainer_gpus: weight_transport 'engine' with the replicas on GPUs needs the trainer on CUDA too "
            "(vLLM's nccl engine links two GPUs; a CPU trainer feeds GPU replicas over the weight stream: "
            "weight_transport 'zmq')"
        )


def check_factory_signature(field: str, spec: str, factory: Any) -> None:
    """A rollout factory is called with one argument, the run's `RolloutSetup` (`make_rollout_fn(setup) ->
    rollout_fn`, by every gateway as it starts): one whose parameters cannot take that call is refused naming
    `field`. A callable whose signature cannot be read (a builtin) is left to the gateway."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object())
    except TypeError:
        shown = f"{getattr(factory, '__name__', type(factory).__name__)}{signature}"
        raise ConfigError(
            f"{field}: {spec!r} is {shown}: a rollout factory is called with one argument, the run's RolloutSetup "
            "(def make_rollout_fn(setup) -> rollout_fn)"
        ) from None


def check_journal_data(journal: Path, run: Config) -> None:
    """--resume: the journal's cursor is of the data the config names: one dataset's position, or a mixture's
    (`datasets`). Switching between the two cannot continue the run exactly, so it is refused naming the field;
    a mixture whose sources changed continues the ones it knows (a new source starts at its beginning)."""
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=5.0)
        try:
            found = db.execute("SELECT value FROM state WHERE key = 'cursor'").fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return  # damage is check_journal's to name; a lock is waited out by the controller
    if found is None:
        return
    try:
        mixture = isinstance(json.loads(found[0]), dict)
    except ValueError:
        return
    if run.datasets and not mixture:
        raise ConfigError(
            f"run.datasets: the run in {journal.parent} was started with one dataset (run.dataset), so its journal "
            "holds one cursor: resume it with that dataset, or start a mixture over with --overwrite"
        )
    if not run.datasets and mixture:
        raise ConfigError(
            f"run.dataset: the run in {journal.parent} was started with a dataset mixture (run.datasets): resume it "
            "with the same datasets, or start over with --overwrite"
        )
