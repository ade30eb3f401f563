"""`fleetrl up run.toml`: start controller, inference replicas, trainer, gateways (and a reference service with
reference_placement = "service", kl_beta > 0 without LoRA; by default the reference is colocated in the trainer) as
local processes on loopback (free ports), show progress, and stop everything cleanly at the end.

    fleetrl up examples/arithmetic/run.toml [--set key=value ...] [--resume [--restart-weights] | --overwrite]

`--resume` continues the run in `log_path` after a crash or a stop: the controller from its SQLite journal, the
trainer from its last checkpoint (every `dcp_save_interval` steps, and at every stop: Ctrl-C saves the last
trained step), the replicas from the weights the trainer publishes at that version; metrics.jsonl keeps one line
per step (the lines of steps after the checkpoint are replaced by the retrained ones). A resume whose trainer has
no checkpoint fails unless `--restart-weights` allows training the journal's rows again from the base model. A
log_path that holds a run is never reused without `--resume`, or `--overwrite` (which deletes it first). A log_path
is owned by one live run (fleetrl.up.log_dir.lock_log_dir): a second `fleetrl up` there, with or without `--resume`
or `--overwrite`, is refused (exit 2) naming the live run's pid, touching nothing.

Ctrl-C or SIGTERM stops the services one kind at a time: gateways, then the controller (it finishes the step in
flight), then the trainer (it checkpoints the last step), then reference and replicas; a second Ctrl-C stops at
once. A run that trains nothing fails with the reason (e.g. every prompt longer than max_seq_len) and exports
nothing.

Each child's log is `<log_path>/<service>.log`. A crashed service stops the run with its log tail and a non-zero
exit; a crashed gateway is replaced (unless its circuit breaker opened: the rollout function is broken), and a
crashed inference replica is restarted (`max_replica_restarts`): it rejoins the run through the controller, which
pushes it the current version before routing rollouts to it.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError, check_warm_start_adapter, wants_reference_logprobs
from fleetrl.exit_codes import EXIT_CIRCUIT_OPEN, EXIT_CONTROLLER_LOST, EXIT_USER_CODE
from fleetrl.model_path import ModelNotFoundError, adapter_instead_of_model, check_model_path
from fleetrl.trackers import TrackerError, check_trackers_available
from fleetrl.up.auth import run_auth_token
from fleetrl.up.config import UpConfig, load_run_and_up
from fleetrl.up.console import LogFollower, Startup, print_services
from fleetrl.up.cpu_threads import ThreadPlan, available_cpus, plan_threads, reproducible_math_env
from fleetrl.up.inprocess_gateway import (
    InProcessGateway,
    UserObjects,
    gateway_log_handler,
    remove_log_handler,
    start_gateways,
)
from fleetrl.up.log_dir import JOURNAL, LogDirError, RunLock, lock_run_folders, prepare_log_dir, run_files
from fleetrl.up.progress import Progress, planned_steps
from fleetrl.up.start_checks import (
    check_custom_loss,
    check_factory_signature,
    check_journal_data,
    check_model_folder,
    check_process_environment,
    check_run_environment,
    check_weight_transport,
)
from fleetrl.up.supervisor import Child, ServiceFailed, Supervisor, log_tail, torchrun_argv


def user_spec(spec: str, config_dir: Path) -> str:
    """A file path in the spec is taken relative to the run config's folder."""
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py") and not Path(module).is_absolute():
        module = str((config_dir / module).resolve())
    return f"{module}:{attr}"


def check_user_code(up: UpConfig, config_dir: Path) -> None:
    """The user's code that `[up]` names (`rollout`, `evaluation`, `dynamic_filter`), loaded here as a gateway will
    load it (`check_user_object`), before any service starts."""
    rollout = user_spec(up.rollout, config_dir)
    check_factory_signature("up.rollout", rollout, check_user_object("up.rollout", rollout, config_dir))
    if up.evaluation:
        check_user_object("up.evaluation", user_spec(up.evaluation, config_dir), config_dir)
    if up.dynamic_filter and up.dynamic_filter != "uniform":  # handed to the gateways as written
        check_user_object("up.dynamic_filter", up.dynamic_filter, config_dir)


def check_advantage_estimator(name: str) -> None:
    """A user's advantage estimator (`run.advantage_estimator` as an import path) imported and given its trial call
    here, as the trainer will, before any service starts (fleetrl.trainer.advantage_estimators)."""
    if ":" not in name:  # a built-in one (the config's validator refused any other name)
        return
    from fleetrl.trainer.advantage_estimators import load_estimator  # imports torch: only for a user's estimator

    added = [os.getcwd()] if os.getcwd() not in sys.path else []
    sys.path[:0] = added
    try:
        load_estimator(name)
    except ValueError as exc:
        raise ConfigError(f"run.{exc}") from None
    finally:
        for path in added:
            sys.path.remove(path)


def check_user_object(field: str, spec: str, config_dir: Path) -> Any:
    """`spec` names a callable the gateways can load: imported here, with the run config's folder and the working
    directory on the import path as a gateway has them (its PYTHONPATH, `python -m`). Raises ConfigError naming
    `field` and what is wrong (no such module, file or attribute, an error the module raised on import, not a
    callable), instead of a gateway failing with it after every service started. Returns the callable."""
    from fleetrl.user_code import load_object

    added = [p for p in (str(config_dir.resolve()), os.getcwd()) if p not in sys.path]
    sys.path[:0] = added
    try:
        loaded = load_object(spec)
    except ValueError as exc:  # load_object's own: names the spec and what is missing
        raise ConfigError(f"{field}: {exc}") from None
    except Exception as exc:  # the user's module raised while importing (SyntaxError, ImportError, ...)
        raise ConfigError(f"{field}: importing {spec!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        for path in added:
            if path in sys.path:
                sys.path.remove(path)
    if not callable(loaded):
        raise ConfigError(f"{field}: {spec!r} is a {type(loaded).__name__}, not a callable")
    return loaded


def evaluation_needs_rows(spec: str, config_dir: Path) -> bool:
    """Whether the `[up] evaluation` hook evaluates run.eval_dataset's rows: fleetrl's `(setup, rows)` shape, or a
    hook that cannot be loaded here (its gateway says why). The current cookbook's `(step, rollout_fn)` owns its
    rows; a hook whose shape cannot be read is refused naming evaluation_fn (`ConfigError`)."""
    from fleetrl.rollout import evaluation_call_shape
    from fleetrl.user_code import load_object

    try:
        evaluation_fn = load_object(user_spec(spec, config_dir))
    except Exception:  # the user's module: any import error; the gateway that loads it reports it
        return True
    try:
        return evaluation_call_shape(evaluation_fn) == "setup_rows"
    except ValueError as exc:
        raise ConfigError(f"up.evaluation: {exc}") from None


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in an argv list (`--flag V` or `--flag=V`), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def check_group_size(run: Config) -> None:
    """completions_per_prompt within what a gateway can hold (fleetrl.gateway.config.MAX_COMPLETIONS_PER_PROMPT):
    refused here, before a gateway crashes on it and is restarted again and again."""
    from fleetrl.gateway.config import MAX_COMPLETIONS_PER_PROMPT

    if run.completions_per_prompt > MAX_COMPLETIONS_PER_PROMPT:
        raise ConfigError(
            f"run.completions_per_prompt = {run.completions_per_prompt}: at most {MAX_COMPLETIONS_PER_PROMPT} "
            "(a row's samples are held and sent together as one group)"
        )


def check_datasets(run: Config) -> None:
    """A missing or unreadable `run.dataset` / `run.eval_dataset` / `run.datasets[i].path` file fails the config
    check (ConfigError naming the field), before any service starts (fleetrl.controller.rows.check_rows_source
    looks at its start only)."""
    from fleetrl.controller.rows import check_rows_source

    fields = [("dataset", run.dataset), ("eval_dataset", run.eval_dataset)]
    fields += [(f"datasets[{i}].path", source.path) for i, source in enumerate(run.datasets or [])]
    for field, source in fields:
        if source is None or (field == "eval_dataset" and not source):
            continue
        try:
            check_rows_source(source)
        except ValueError as exc:
            raise ConfigError(f"run.{field}: {exc}") from None


def check_log_dir(run: Config, up: UpConfig, *, resume: bool, overwrite: bool) -> RunLock | None:
    """Take `log_path` and the checkpoint folder for this run, and check its output folder (each refused while
    another live run owns it or a folder above it: `lock_run_folders`), then check them: resume the run they hold
    (its latest whole checkpoint: `check_resume_checkpoint`), or refuse to start over without --overwrite (then
    delete it). Returns the lock, to hold for the run's life (`launch` hands it to the services); raises
    LogDirError. A run that only attaches gateways to a running controller is not checked and takes no lock."""
    if up.controller_address is not None:
        return None
    log_dir = Path(run.log_path)
    if resume and overwrite:
        raise LogDirError("--resume continues the run in log_path and --overwrite deletes it: choose one")
    if log_dir.exists() and not log_dir.is_dir():
        raise LogDirError(f"run.log_path: {log_dir} is a file, not a folder: name a folder for the run's files")
    checkpoint_dir, output_dir = run_folders(run, up)
    lock = lock_run_folders(log_dir, dict([checkpoint_dir]), unlocked=dict([output_dir]))
    try:
        _prepare(run, up, log_dir, checkpoint_dir[1], output_dir[1], lock, resume=resume, overwrite=overwrite)
        if resume:
            journal = Path(_flag_value(up.controller_args, "--journal") or log_dir / JOURNAL)
            check_resume_journal(log_dir, journal, run_files(log_dir, checkpoint_dir[1], output_dir[1]))
            check_journal_data(journal, run)  # one dataset's cursor, or a mixture's: as the config says
            check_resume_checkpoint(checkpoint_dir[1])
    except BaseException:
        lock.release()
        raise
    return lock


def check_resume_journal(log_dir: Path, journal: Path, discard: list[Path]) -> None:
    """--resume: refuse a damaged controller journal (fleetrl.controller.journal.check_journal) before any service
    starts, naming what --overwrite would discard instead (`discard`: the run's files, `run_files`)."""
    from fleetrl.controller.journal import JournalDamaged, check_journal

    try:
        check_journal(journal)
    except JournalDamaged as exc:
        names = ", ".join(str(p) for p in dict.fromkeys([journal, *discard]))
        raise LogDirError(
            f"--resume: {exc}: the run in {log_dir} cannot be resumed, nothing was started; --overwrite would "
            f"discard {names} and the service logs"
        ) from None


def check_resume_checkpoint(checkpoint_dir: Path) -> None:
    """--resume: verify the checkpoint the trainer will load (fleetrl.checkpoint_manifest.resume_checkpoint) before
    any service starts. A damaged latest is passed over for the newest whole one, said here (the trainer does the
    same and the controller's journal aligns to that version); none whole raises LogDirError naming the damaged
    file."""
    from fleetrl.checkpoint_manifest import CheckpointDamaged, resume_checkpoint

    try:
        point = resume_checkpoint(checkpoint_dir)
    except CheckpointDamaged as exc:
        raise LogDirError(
            f"--resume: {exc}; nothing was started (move the damaged checkpoints aside, and --restart-weights "
            "trains the journal's rows again from the base model)"
        ) from None
    if (note := point.note()) is not None:
        print(f"fleetrl up: --resume: {note}", file=sys.stderr)


def run_folders(run: Config, up: UpConfig) -> tuple[tuple[str, Path], tuple[str, Path]]:
    """The folders besides log_path that the run writes and `--overwrite` empties, each with its role for messages:
    the trainer's checkpoints and the final export."""
    log_dir = Path(run.log_path)
    checkpoint_flag = _flag_value(up.trainer_args, "--checkpoint-dir")
    output_flag = _flag_value(up.trainer_args, "--output-dir")
    checkpoint_what = "the checkpoint folder" + (" (up.trainer_args --checkpoint-dir)" if checkpoint_flag else "")
    output_what = "the output folder" + (
        " (up.trainer_args --output-dir)" if output_flag else " (run.output_dir)" if run.output_dir else ""
    )
    return (
        (checkpoint_what, Path(checkpoint_flag or log_dir / "checkpoints")),
        (output_what, Path(output_flag or run.output_dir or log_dir / "final")),
    )


def _prepare(
    run: Config,
    up: UpConfig,
    log_dir: Path,
    checkpoint_dir: Path,
    output_dir: Path,
    lock: RunLock,
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    journal = _flag_value(up.controller_args, "--journal")
    removed = prepare_log_dir(
        log_dir,
        resume=resume,
        overwrite=overwrite,
        checkpoint_dir=checkpoint_dir,
        output_dir=output_dir,
        journal=Path(journal) if journal else None,
        held=lock.held,
    )
    if overwrite and removed:
        print(f"fleetrl up: --overwrite: deleted {', '.join(str(p) for p in removed)}", file=sys.stderr)


def launch(
    config_path: Path,
    sets: list[str],
    run: Config,
    up: UpConfig,
    resume: bool = False,
    restart_weights: bool = False,
    objects: UserObjects | None = None,
    lock: RunLock | None = None,
) -> int:
    """Start every service and watch the run; `log_path` must have been checked (`check_log_dir`, whose `lock` the
    services inherit: the folder stays owned until the last of them exits). With `objects` (fleetrl.main) the
    gateways run in this process, given those Python objects; else each is a process."""
    log_dir = Path(run.log_path)
    metrics_path = log_dir / "metrics.jsonl"
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(config_path.parent.resolve()), os.environ.get("PYTHONPATH")]))
    }
    token = run_auth_token(up.auth_token, log_dir, attach=up.controller_address is not None)
    if token:  # on by default: every child requires it, so no other local process can call or inject
        env["FLEETRL_AUTH_TOKEN"] = token
    env.update(reproducible_math_env(os.environ))  # same seed, same weights (docs/ARCHITECTURE.md, "Determinism")
    threads = _thread_plan(run, up)
    if threads is not None:
        env.update(threads.env("light"))  # controller and gateways; compute services get their share below
    sup = Supervisor(log_dir, env, keep_fds=lock.fds if lock is not None else ())
    common = ["--config", str(config_path), *[a for s in sets for a in ("--set", s)]]
    stop_requested: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_requested.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    controller_flags = ["--resume", *(["--restart-weights"] if restart_weights else [])] if resume else []
    progress: Progress | None = None
    gateways: list[Any] = []
    log_handler = gateway_log_handler(log_dir / "gateway.log") if objects is not None else None
    try:
        gateway_argv = [*common, "--rollout", user_spec(up.rollout, config_path.parent), "--metrics-port", "0"]
        gateway_argv += up.gateway_args
        if up.dynamic_filter:
            gateway_argv += ["--dynamic-filter", up.dynamic_filter]
        # The judge pool first: the gateways (started early below) are handed its addresses on their command line.
        gateway_argv += judge_gateway_flags(up, start_judges(sup, run, up, threads))
        evaluation = user_spec(up.evaluation, config_path.parent) if up.evaluation else None
        early = objects is None and up.controller_address is None
        if early:
            # Gateway processes start with the stack (their imports and tokenizer load overlap its start-up) and
            # read the controller's address from its ready file once it serves.
            ready = sup.log_dir / "ready" / "controller.json"
            ready.unlink(missing_ok=True)  # a previous run's (resume): never read a stale address
            wait_s = str(3 * up.startup_timeout_s)
            gateways += _start_gateway_processes(
                sup,
                [*gateway_argv, "--controller-ready-file", str(ready), "--controller-ready-timeout", wait_s],
                up.gateways,
                evaluation,
            )
        if up.controller_address is not None and (reason := attach_refusal(up.controller_address, token)):
            print(f"fleetrl up: {reason}", file=sys.stderr)
            return 1
        if up.controller_address is None:
            with Startup(stack_size(run, up)) as startup:
                controller = _start_stack(sup, common, run, up, resume, controller_flags, threads, startup)
        else:
            controller = None
        controller_address = up.controller_address or controller.info["address"]  # type: ignore[union-attr]
        gateway_argv += ["--controller", controller_address]
        if objects is not None:  # any callable works: the gateways share this process with the user's code
            gateways += start_gateways(gateway_argv, up.gateways, evaluation, objects, log_dir, token)
        elif not early:
            gateways += _start_gateway_processes(sup, gateway_argv, up.gateways, evaluation)
        print_services(sup.children)
        if objects is not None:
            print(f"  {up.gateways} gateway(s) in this process, log {log_dir / 'gateway.log'}", file=sys.stderr)
        progress = Progress(metrics_path, planned_steps(run), from_end=resume)
        return _watch(sup, controller, gateways, gateway_argv, up, progress, stop_requested)
    except ServiceFailed as exc:
        print(
            f"fleetrl up: {exc}\n--- last lines of {exc.child.log_path} ---\n{log_tail(exc.child.log_path)}",
            file=sys.stderr,
        )
        return 1
    finally:
        if progress is not None:
            progress.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # from here a second Ctrl-C stops at once
        for gateway in gateways:  # in-process gateways stop first, as gateway processes do in stop_all
            if isinstance(gateway, InProcessGateway):
                gateway.stop()
        if log_handler is not None:
            remove_log_handler(log_handler)
        sup.stop_all(patient=stop_patience(sup.children, up.stop_timeout_s))
        if stop_requested and controller_started(sup):
            print(f"fleetrl up: stopped; `fleetrl up {config_path} --resume` continues the run", file=sys.stderr)


def attach_refusal(address: str, token: str | None, wait_s: float = 10.0) -> str | None:
    """Why gateways cannot join the run at `address` (None: a running run answers there): its controller says the
    run is over, or nothing answers within `wait_s` (a finished run's controller has exited). Said at once, rather
    than after a gateway waited `controller_lost_s` for a controller that is gone."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from fleetrl.commands.status import fetch_status

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with ThreadPoolExecutor(1) as pool:  # its own event loop: the caller may be inside one (a notebook)
                status = pool.submit(asyncio.run, fetch_status(address, 5.0, token)).result()
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if transient and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            if transient:
                return f"no run answers at {address} within {wait_s:.0f} s ({code.name}): it finished, or is gone"
            return f"the controller at {address} refused to answer: {code.name}: {exc.details()}"  # type: ignore[attr-defined]
        if status.get("finished"):
            how = f"ended: {status['error']}" if status.get("error") else "finished"
            return f"the run at {address} has {how} (step {status.get('trained_steps', 0)}): nothing to join"
        return None


def _start_gateway_processes(sup: Supervisor, argv: list[str], count: int, evaluation: str | None) -> list[Child]:
    gateways = []
    for i in range(count):
        args = list(argv)
        if i == 0 and evaluation:  # one gateway evaluates held-out rows when the controller asks
            args += ["--evaluation", evaluation]
        gateways.append(sup.start(f"gateway-{i}", "gateway", args, ready=False))
    return gateways


def controller_started(sup: Supervisor) -> bool:
    return any(c.kind == "controller" for c in sup.children)


def _pick_ports(*names: str) -> list[str]:
    """`--<name>-port 0` for each endpoint: every service binds a free port and reports it in its ready file."""
    return [flag for name in names for flag in (f"--{name}-port", "0")]


def lora_flags(run: Config) -> list[str]:
    """Replica flags for a LoRA run: serve adapter versions up to the run's rank (none for full fine-tuning)."""
    return ["--max-lora-rank", str(run.lora_rank)] if run.lora_rank > 0 else []


def _address(info: dict[str, Any]) -> str:
    return f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}"


def gpu_serving_dtype(run: Config, up: UpConfig) -> str | None:
    """bfloat16 when the replicas run on GPUs (`inference_gpus`) and the run leaves `inference_dtype` unset: the
    trainer then publishes bf16 and the replicas serve it (half the bytes per push, vLLM's GPU default) instead of
    float32 inherited from the trainer's master weights; None keeps the run's own setting."""
    return "bfloat16" if up.inference_gpus is not None and run.inference_dtype is None else None


def needs_reference(run: Config) -> bool:
    """A reference is needed for kl_beta > 0 or a distillation teacher (teacher_model), with full fine-tuning; a LoRA
    trainer disables its adapter instead."""
    return wants_reference_logprobs(run) and not run.lora


def reference_model_args(run: Config) -> list[str]:
    """The model a reference service holds: the teacher (with the run's tokenizer to check it against at start) when
    teacher_model is set, else the base model."""
    if run.teacher_model is None:
        return ["--model", run.base_model]
    return ["--model", run.teacher_model, "--student-model", run.tokenizer_model or run.base_model]


def check_teacher_model(run: Config) -> None:
    """A teacher_model that is no model, or whose tokenizer reads ids otherwise than the run's, fails here (before
    any service starts), naming the field and both models."""
    if run.teacher_model is None:
        return
    check_model_path(run.teacher_model, "run.teacher_model")
    from fleetrl.tokenizer_match import check_same_tokenizer

    try:
        check_same_tokenizer(run.tokenizer_model or run.base_model, run.teacher_model, field="teacher_model")
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith("teacher_model") else f"run.teacher_model: {exc}") from None


def reference_service(run: Config, up: UpConfig) -> bool:
    """The reference runs as its own process (reference_placement = "service"); by default it is a frozen copy in
    the trainer's ranks (`--reference local`) and no process starts."""
    return needs_reference(run) and up.reference_placement == "service"


def reference_dtype(run: Config, up: UpConfig) -> str:
    """The trainer's compute dtype, which a reference service runs in (the KL is of like with like): compute_dtype,
    where "auto" is bfloat16 on CUDA and the weight dtype elsewhere (fleetrl.trainer.inner_loop's rule)."""
    if run.compute_dtype != "auto":
        return run.compute_dtype
    return "bfloat16" if up.trainer_on_cuda else run.dtype


def reference_service_args(run: Config, up: UpConfig) -> list[str]:
    """A reference service's device and dtype: the trainer's (cuda on its reference_gpus, else the trainer's CPU)."""
    device = "cuda" if up.reference_gpus is not None else up.trainer_device
    return ["--device", device, "--dtype", reference_dtype(run, up)]


def start_judges(
    sup: Supervisor, run: Config, up: UpConfig, threads: ThreadPlan | None, stream: Any = None
) -> list[dict[str, Any]]:
    """The judge pool ([up] judge_model): `judge_replicas` inference replicas of the judge (`judge-<i>`), frozen: the
    controller is never told of them, so no version is ever pushed to them. Returns their ready-file infos (gRPC and
    HTTP ports) once all serve; [] without a judge."""
    if up.judge_model is None:
        return []
    engine = up.judge_engine or up.engine
    env = threads.env("inference") if threads is not None and engine == "hf" else {}
    judges = []
    for i in range(up.judge_replicas):
        args = ["--model", up.judge_model, "--engine", engine, *_pick_ports("grpc", "http", "metrics")]
        args += ["--seed", str(run.seed + 1000 + i), "--dtype", run.inference_dtype or run.dtype, *up.judge_args]
        judges.append(sup.start(f"judge-{i}", "inference", args, env=env))
    with Startup(len(judges), stream=stream) as startup:
        infos = []
        for judge in judges:
            startup.waiting(judge.name)
            infos.append(sup.wait_ready(judge, up.startup_timeout_s))
            startup.ready(judge)
    return infos


def judge_gateway_flags(up: UpConfig, judges: list[dict[str, Any]]) -> list[str]:
    """The gateway flags that hand rollouts the judge pool: each replica's gRPC address (setup.judge_sampler), the
    first one's OpenAI base URL (setup.judge_base_url) and the judge's model name."""
    if not judges:
        return []
    flags = [flag for info in judges for flag in ("--judge", _address(info))]
    first = judges[0]
    flags += ["--judge-base-url", f"http://{first.get('host', '127.0.0.1')}:{first['http_port']}/v1"]
    return [*flags, "--judge-model", str(up.judge_model)]


def stack_size(run: Config, up: UpConfig) -> int:
    """Services `fleetrl up` waits for before gateways start: replicas, a reference service, trainer, controller."""
    return up.replicas + int(reference_service(run, up)) + 2


def _thread_plan(run: Config, up: UpConfig) -> ThreadPlan | None:
    if not up.split_cpu_threads or "OMP_NUM_THREADS" in os.environ or up.controller_address is not None:
        return None
    hf_replicas = up.replicas if up.engine == "hf" else 0
    return plan_threads(
        available_cpus(),
        trainer_procs=up.trainer_ranks,
        hf_replicas=hf_replicas,
        reference=reference_service(run, up),  # a colocated reference computes inside the trainer's share
        on_policy=run.max_head_offpolicy_versions == 0,
    )


def _start_stack(
    sup: Supervisor,
    common: list[str],
    run: Config,
    up: UpConfig,
    resume: bool,
    controller_flags: list[str],
    threads: ThreadPlan | None,
    startup: Startup,
) -> Child:
    def wait(child: Child, peers: list[Child] | None = None) -> dict[str, Any]:
        startup.waiting(child.name)
        info = sup.wait_ready(child, up.startup_timeout_s, peers or [])
        startup.ready(child)
        return info

    def share(service: str) -> dict[str, str]:
        return {} if threads is None else threads.env(service)

    resume_flag = ["--resume"] if resume else []
    model = ["--model", run.base_model]
    replicas = []
    for i in range(up.replicas):
        args = [*model, "--engine", up.engine, *_pick_ports("grpc", "http", "metrics"), "--seed", str(run.seed + i)]
        args += [
            "--dtype",
            gpu_serving_dtype(run, up) or run.inference_dtype or run.dtype,
        ]  # the trainer publishes in it
        args += lora_flags(run)
        env = {**(share("inference") if up.engine == "hf" else {}), **up.replica_env(i)}
        if up.inference_tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(up.inference_tensor_parallel_size)]
        replicas.append(sup.start(f"inference-{i}", "inference", [*args, *up.inference_args], env=env))
    reference_args: list[str] = []
    if reference_service(run, up):
        ref_args = [*reference_model_args(run), *_pick_ports("grpc", "metrics"), *reference_service_args(run, up)]
        reference = sup.start("reference", "reference", ref_args, env={**share("reference"), **up.reference_env()})
        reference_args = ["--reference", _address(wait(reference))]
    elif needs_reference(run):  # a frozen copy in the trainer's ranks, on its device and compute dtype
        reference_args = ["--reference", "local"]
    trainer_args = [*common, *_pick_ports("grpc", "groups", "weights", "metrics"), *reference_args, *resume_flag]
    if (serving := gpu_serving_dtype(run, up)) is not None:
        trainer_args += ["--set", f"inference_dtype={serving}"]  # publish in the dtype the replicas serve
    if up.trainer_gpus is not None and "--device" not in up.trainer_args:
        trainer_args += ["--device", "cuda"]
    if up.trainer_sharding != "fsdp":
        trainer_args += ["--sharding", up.trainer_sharding]
    trainer_args += up.trainer_args
    trainer, *other_nodes = start_trainer(sup, up, trainer_args, share("trainer"))
    trainer_address = _address(wait(trainer, other_nodes))
    inference_flags = [flag for r in replicas for flag in ("--inference", _address(wait(r)))]
    controller_args = [*common, "--trainer", trainer_address, *inference_flags, *_pick_ports("grpc", "metrics")]
    controller_args += controller_flags
    if up.evaluation:
        controller_args.append("--evaluation")
    controller = sup.start("controller", "controller", [*controller_args, *up.controller_args])
    wait(controller)
    return controller


def start_trainer(sup: Supervisor, up: UpConfig, args: list[str], env: dict[str, str]) -> list[Child]:
    """The trainer: one process, one torchrun agent of `trainer_procs` ranks, or with `trainer_nodes` > 1 one agent
    per node (`trainer-node<i>`), meeting through a c10d rendezvous on a free loopback port. Node 0 starts first
    (so it holds rank 0, which serves); every agent is given the same ready file, written by rank 0."""
    if up.trainer_nodes == 1:
        return [sup.start("trainer", "trainer", args, env={**env, **up.trainer_env()}, nproc=up.trainer_procs)]
    endpoint, run_id = f"127.0.0.1:{free_loopback_port()}", f"fleetrl-trainer-{uuid.uuid4().hex[:12]}"
    launcher = torchrun_argv(up.trainer_procs, up.trainer_nodes, endpoint, run_id)
    return [
        sup.start(
            f"trainer-node{i}",
            "trainer",
            args,
            env={**env, **up.trainer_env(i)},
            launcher=launcher,
            ready_name="trainer",
        )
        for i in range(up.trainer_nodes)
    ]


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _watch(
    sup: Supervisor,
    controller: Child | None,
    gateways: list[Child],
    gateway_argv: list[str],
    up: UpConfig,
    progress: Progress,
    stop_requested: list[int],
) -> int:
    metrics_path = progress.path
    restarts = replica_restarts = 0
    liveness = LogFollower(controller.log_path) if controller is not None else None
    while True:
        progress.update()
        for warning in liveness.new_lines() if liveness is not None else ():
            progress.note(f"fleetrl up: controller: {warning}")
        if stop_requested:
            print(
                f"\nfleetrl up: signal {stop_requested[0]}: stopping every service (the controller finishes its step, "
                "the trainer checkpoints it; signal again to stop at once)",
                file=sys.stderr,
            )
            return 130
        in_process = [g for g in gateways if isinstance(g, InProcessGateway)]
        for child in [*sup.children, *in_process]:
            code = child.poll()
            if code is None or child is controller:
                continue
            if child in sup.children:  # what the exited service started itself (vLLM's engine core) goes with it
                sup.reap(child)
            if child.kind == "gateway":
                if code == 0:
                    continue
                if code == EXIT_CIRCUIT_OPEN:
                    raise ServiceFailed(
                        child, f"{child.name}: circuit breaker open (the rollout function keeps failing)"
                    )
                if code == EXIT_CONTROLLER_LOST and controller is None:  # attached: that run is over or gone
                    raise ServiceFailed(
                        child,
                        f"{child.name}: the run's controller at {up.controller_address} stopped answering (the run "
                        "finished, stopped or failed, and no controller resumed it)",
                    )
                if code == EXIT_USER_CODE:  # deterministic: a restart would fail the same way
                    raise ServiceFailed(
                        child,
                        f"{child.name}: cannot load the user's code (rollout, evaluation, filter), or a rollout "
                        "returned a type that is not a RolloutSample, RolloutRun or None",
                    )
                if restarts >= up.max_gateway_restarts:
                    raise ServiceFailed(child, f"{child.name} crashed (exit {code}) and the restart limit is reached")
                restarts += 1
                name = f"gateway-r{restarts}"
                print(f"\nfleetrl up: {child.name} exited with {code}; starting {name}", file=sys.stderr)
                if isinstance(child, InProcessGateway):  # a fresh task in this process, same objects and role
                    gateways.remove(child)
                    gateways.append(child.restarted(name))
                    continue
                sup.children.remove(child)
                gateways.append(sup.start(name, "gateway", child.argv[5:], ready=False))  # same role, same flags
            elif child.kind == "inference" and controller is not None and not child.name.startswith("judge-"):
                if replica_restarts >= up.max_replica_restarts:
                    raise ServiceFailed(child, f"{child.name} crashed (exit {code}) and the restart limit is reached")
                replica_restarts += 1
                sup.children.remove(child)
                restart_replica(sup, child, controller.info["address"], replica_restarts)
            else:
                raise ServiceFailed(child, f"{child.name} exited with code {code}")
        if controller is not None and (code := controller.poll()) is not None:
            progress.update(final=True)
            if code != 0:
                reason = run_failure(controller.log_path)
                raise ServiceFailed(
                    controller, f"the run failed: {reason}" if reason else f"controller exited with code {code}"
                )
            _wait_gateways(gateways)
            print(f"fleetrl up: run finished; metrics in {metrics_path}")
            if note := dropped_rows_note(metrics_path.parent):
                print(f"fleetrl up: {note}", file=sys.stderr)
            return 0
        if controller is None and all(g.poll() is not None for g in gateways):
            return 0 if all(g.poll() == 0 for g in gateways) else 1
        time.sleep(0.25)


def restart_replica(sup: Supervisor, child: Child, controller_address: str, restart: int) -> Child:
    """Start a crashed replica again with its flags and environment, on new ports, joining the run under its old
    member id (`inference-<i>`, the id the controller gave it from `--inference`): the controller pushes it the
    current version before routing rollouts to it. The run goes on meanwhile on the other replicas, or waits."""
    args = _without_flags(child.argv[5:], ("--ready-file", "--controller", "--member-id"))
    member_id = _flag_value(child.argv, "--member-id") or child.name
    name = f"{member_id}-r{restart}"
    print(
        f"\nfleetrl up: {child.name} exited with {child.poll()}; starting {name} (rejoins as {member_id})",
        file=sys.stderr,
    )
    args += ["--controller", controller_address, "--member-id", member_id]
    return sup.start(name, "inference", args, env=child.env)


def _without_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`args` without each `--flag V` (or `--flag=V`) of `flags`."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f"{f}=" for f in flags)):
            out.append(arg)
    return out


def stop_patience(children: list[Child], stop_timeout_s: float) -> dict[str, float]:
    """How long each kind may take to stop: the trainer to checkpoint its last step, and the controller to finish
    its step in flight, but only while the trainer lives: with a crashed trainer that step (or its weight push,
    fetched from the dead trainer) could only wait out its timeout, holding `fleetrl up` for minutes."""
    patient = {"trainer": stop_timeout_s}
    if any(c.kind == "trainer" and c.poll() is None for c in children):
        patient["controller"] = stop_timeout_s
    return patient


def dropped_rows_note(log_dir: Path) -> str | None:
    """What a finished run left out (its controller's run_end.json): rows dropped as too slow, or failing every
    attempt; None when none. Such a run still exits 0 (docs/ARCHITECTURE.md, "Failure modes")."""
    from fleetrl.commands.status import read_end_record

    record = read_end_record(log_dir) or {}
    slow, failing = int(record.get("rows_dropped_slow") or 0), int(record.get("rows_dropped_failing") or 0)
    parts = []
    if slow:
        parts.append(
            f"{slow} rows dropped as too slow (stale on every attempt: slower than max_head_offpolicy_versions "
            "allows; raise it or the controller's --max-stale-attempts to keep them)"
        )
    if failing:
        parts.append(f"{failing} rows dropped after failing on every attempt")
    return "; ".join(parts) or None


def run_failure(controller_log: Path) -> str | None:
    """The reason the controller logged for a failed run (its last 'run failed: ' line), or None."""
    marker = "run failed: "
    for line in reversed(log_tail(controller_log, 200).splitlines()):
        if marker in line:
            return line.split(marker, 1)[1].removeprefix("RunFailed: ")
    return None


def _wait_gateways(gateways: list[Child], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(g.poll() is None for g in gateways):
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl up", description="Run every fleetrl service locally.")
    parser.add_argument("config", type=Path, help="run.toml with a [run] and an [up] table")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a [run] key (max_steps=50), or an [up] key with its prefix (up.engine=vllm)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in log_path: controller journal, the trainer's last checkpoint, one line per step",
    )
    parser.add_argument(
        "--restart-weights",
        action="store_true",
        help="with --resume: if the trainer has no checkpoint, train the journal's rows again from the base model",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a log_path that holds a run: delete its journal, metrics, checkpoints, export and logs",
    )
    args = parser.parse_args(argv)
    if args.restart_weights and not args.resume:
        parser.error("--restart-weights goes with --resume")
    try:
        run, up, run_sets = load_run_and_up(args.config, args.set)
        check_process_environment(os.environ, up.auth_token)  # what every service reads as it starts
        check_weight_transport(run, up)  # run.weight_transport "engine": vllm replicas, one trainer rank, CPU
        if not run.base_model and up.controller_address is None:
            raise ConfigError("run.base_model: the model to train is required")
        if up.controller_address is None:
            check_model_path(run.base_model, "run.base_model")
            if (adapter := adapter_instead_of_model(run.base_model)) is not None:
                raise ConfigError(f"run.base_model: {adapter}")
            check_model_path(run.tokenizer_model or "", "run.tokenizer_model")
            check_warm_start_adapter(run)  # the trainer runs here: its adapter folder must be here too
            check_model_folder(run.teacher_model, "run.teacher_model")  # a model: config.json and weights
            check_teacher_model(run)  # the teacher's tokenizer against the run's, before anything starts
            if up.judge_model is not None:
                check_model_path(up.judge_model, "up.judge_model")
                check_model_folder(up.judge_model, "up.judge_model")
            check_custom_loss(run, args.config.parent)  # imported and tried as the trainer will
        check_trackers_available(run.loggers)  # a missing extra fails here, before any service starts
        if up.evaluation and not run.eval_dataset and evaluation_needs_rows(up.evaluation, args.config.parent):
            raise ConfigError("run.eval_dataset: [up] evaluation is set: name the held-out rows (JSONL or Parquet)")
        if up.controller_address is None:
            check_datasets(run)  # here, not in the controller once every service started
        check_group_size(run)
        check_user_code(up, args.config.parent)  # before check_log_dir, which may delete (--overwrite)
        check_advantage_estimator(run.advantage_estimator)
        check_run_environment(run, args.config.parent)  # rollout_extras.environment: loaded, with tasks
        lock = check_log_dir(run, up, resume=args.resume, overwrite=args.overwrite)
    except (ConfigError, LogDirError, ModelNotFoundError, TrackerError) as exc:
        print(f"fleetrl up: {exc}", file=sys.stderr)
        return 2
    try:  # the lock is held until this process (and every service it started) has exited
        return launch(
            args.config, run_sets, run, up, resume=args.resume, restart_weights=args.restart_weights, lock=lock
        )
    except KeyboardInterrupt:  # a second Ctrl-C while stopping: the children get SIGTERM as fleetrl up exits
        print("fleetrl up: stopped at once", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(
            f"fleetrl up: {exc.strerror} ({exc.filename or run.log_path}): the disk is full; every service was "
            f"stopped. Free space, then `fleetrl up {args.config} --resume` continues the run",
            file=sys.stderr,
        )
        return 1
