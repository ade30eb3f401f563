"""`fleetrl up run.toml`: start controller, inference replicas, reference (when kl_beta > 0), trainer and gateways
as local processes on loopback (free ports), show progress, and stop everything cleanly at the end.

    fleetrl up examples/arithmetic/run.toml [--set key=value ...] [--resume]

`--resume` continues the run in `log_path` after a crash or a stop: the controller from its SQLite journal, the
trainer from its last checkpoint (every `dcp_save_interval` steps), the replicas from the weights the trainer
publishes at that version; metrics.jsonl is appended to.

Each child's log is `<log_path>/<service>.log`. A crashed service stops the run with its log tail and a non-zero
exit; a crashed gateway is replaced (unless its circuit breaker opened: the rollout function is broken).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError, parse_override
from fleetrl.up.config import UpConfig
from fleetrl.up.cpu_threads import ThreadPlan, available_cpus, plan_threads
from fleetrl.up.progress import Progress
from fleetrl.up.supervisor import Child, ServiceFailed, Supervisor, log_tail

EXIT_CIRCUIT_OPEN = 3


def user_spec(spec: str, config_dir: Path) -> str:
    """A file path in the spec is taken relative to the run config's folder."""
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py") and not Path(module).is_absolute():
        module = str((config_dir / module).resolve())
    return f"{module}:{attr}"


def launch(config_path: Path, sets: list[str], run: Config, up: UpConfig, resume: bool = False) -> int:
    log_dir = Path(run.log_path)
    metrics_path = log_dir / "metrics.jsonl"
    if not resume:
        metrics_path.unlink(missing_ok=True)
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(config_path.parent.resolve()), os.environ.get("PYTHONPATH")]))
    }
    if up.auth_token:
        env["FLEETRL_AUTH_TOKEN"] = up.auth_token
    threads = _thread_plan(run, up)
    if threads is not None:
        env.update(threads.env("light"))  # controller and gateways; compute services get their share below
    sup = Supervisor(log_dir, env)
    common = ["--config", str(config_path), *[a for s in sets for a in ("--set", s)]]
    stop_requested: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_requested.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        controller = _start_stack(sup, common, run, up, resume, threads) if up.controller_address is None else None
        controller_address = up.controller_address or controller.info["address"]  # type: ignore[union-attr]
        gateway_argv = [
            *common,
            "--rollout",
            user_spec(up.rollout, config_path.parent),
            "--controller",
            controller_address,
            "--metrics-port",
            "0",
            *up.gateway_args,
        ]
        if up.dynamic_filter:
            gateway_argv += ["--dynamic-filter", up.dynamic_filter]
        gateways = []
        for i in range(up.gateways):
            args = list(gateway_argv)
            if i == 0 and up.evaluation:  # one gateway evaluates held-out rows when the controller asks
                args += ["--evaluation", user_spec(up.evaluation, config_path.parent)]
            gateways.append(sup.start(f"gateway-{i}", "gateway", args, ready=False))
        progress = Progress(metrics_path, run.max_steps, from_end=resume)
        return _watch(sup, controller, gateways, gateway_argv, up, progress, stop_requested)
    except ServiceFailed as exc:
        print(
            f"fleetrl up: {exc}\n--- last lines of {exc.child.log_path} ---\n{log_tail(exc.child.log_path)}",
            file=sys.stderr,
        )
        return 1
    finally:
        sup.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _pick_ports(*names: str) -> list[str]:
    """`--<name>-port 0` for each endpoint: every service binds a free port and reports it in its ready file."""
    return [flag for name in names for flag in (f"--{name}-port", "0")]


def _address(info: dict[str, Any]) -> str:
    return f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}"


def _thread_plan(run: Config, up: UpConfig) -> ThreadPlan | None:
    if not up.split_cpu_threads or "OMP_NUM_THREADS" in os.environ or up.controller_address is not None:
        return None
    hf_replicas = up.replicas if up.engine == "hf" else 0
    return plan_threads(
        available_cpus(), trainer_procs=up.trainer_procs, hf_replicas=hf_replicas, reference=run.kl_beta > 0
    )


def _start_stack(
    sup: Supervisor, common: list[str], run: Config, up: UpConfig, resume: bool, threads: ThreadPlan | None
) -> Child:
    t = up.startup_timeout_s

    def share(service: str) -> dict[str, str]:
        return {} if threads is None else threads.env(service)

    resume_flag = ["--resume"] if resume else []
    model = ["--model", run.base_model]
    replicas = []
    for i in range(up.replicas):
        args = [*model, "--engine", up.engine, *_pick_ports("grpc", "http", "metrics"), "--seed", str(run.seed + i)]
        env = {**(share("inference") if up.engine == "hf" else {}), **up.replica_env(i)}
        replicas.append(sup.start(f"inference-{i}", "inference", [*args, *up.inference_args], env=env))
    reference_args: list[str] = []
    if run.kl_beta > 0:
        ref_args = [*model, *_pick_ports("grpc", "metrics")]
        reference = sup.start("reference", "reference", ref_args, env=share("reference"))
        reference_args = ["--reference", _address(sup.wait_ready(reference, t))]
    trainer_args = [*common, *_pick_ports("grpc", "groups", "weights", "metrics"), *reference_args, *resume_flag]
    if up.trainer_gpus is not None and "--device" not in up.trainer_args:
        trainer_args += ["--device", "cuda"]
    trainer_args += up.trainer_args
    trainer_env = {**share("trainer"), **up.trainer_env()}
    trainer = sup.start("trainer", "trainer", trainer_args, env=trainer_env, nproc=up.trainer_procs)
    trainer_address = _address(sup.wait_ready(trainer, t))
    inference_flags = [flag for r in replicas for flag in ("--inference", _address(sup.wait_ready(r, t)))]
    controller_args = [*common, "--trainer", trainer_address, *inference_flags, *_pick_ports("grpc", "metrics")]
    controller_args += resume_flag
    if up.evaluation:
        controller_args.append("--evaluation")
    controller = sup.start("controller", "controller", [*controller_args, *up.controller_args])
    sup.wait_ready(controller, t)
    return controller


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
    restarts = 0
    while True:
        progress.update()
        if stop_requested:
            print(f"\nfleetrl up: signal {stop_requested[0]}: stopping every service", file=sys.stderr)
            return 130
        for child in sup.children:
            code = child.poll()
            if code is None or child is controller:
                continue
            if child.kind == "gateway":
                if code == 0:
                    continue
                if code == EXIT_CIRCUIT_OPEN:
                    raise ServiceFailed(
                        child, f"{child.name}: circuit breaker open (the rollout function keeps failing)"
                    )
                if restarts >= up.max_gateway_restarts:
                    raise ServiceFailed(child, f"{child.name} crashed (exit {code}) and the restart limit is reached")
                restarts += 1
                sup.children.remove(child)
                name = f"gateway-r{restarts}"
                print(f"\nfleetrl up: {child.name} exited with {code}; starting {name}", file=sys.stderr)
                gateways.append(sup.start(name, "gateway", child.argv[5:], ready=False))  # same role, same flags
            else:
                raise ServiceFailed(child, f"{child.name} exited with code {code}")
        if controller is not None and (code := controller.poll()) is not None:
            progress.update(final=True)
            if code != 0:
                raise ServiceFailed(controller, f"controller exited with code {code}")
            _wait_gateways(gateways)
            print(f"fleetrl up: run finished; metrics in {metrics_path}")
            return 0
        if controller is None and all(g.poll() is not None for g in gateways):
            return 0 if all(g.poll() == 0 for g in gateways) else 1
        time.sleep(0.25)


def _wait_gateways(gateways: list[Child], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(g.poll() is None for g in gateways):
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl up", description="Run every fleetrl service locally.")
    parser.add_argument("config", type=Path, help="run.toml with a [run] and an [up] table")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run key")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in log_path: controller journal, the trainer's last checkpoint, metrics appended",
    )
    args = parser.parse_args(argv)
    try:
        run = Config.from_toml(args.config, dict(parse_override(s) for s in args.set))
        up = UpConfig.from_file(args.config)
        if not run.base_model and up.controller_address is None:
            raise ConfigError("run.base_model: the model to train is required")
        if up.evaluation and not run.eval_dataset:
            raise ConfigError("run.eval_dataset: [up] evaluation is set: name the held-out rows (JSONL or Parquet)")
    except ConfigError as exc:
        print(f"fleetrl up: {exc}", file=sys.stderr)
        return 2
    return launch(args.config, args.set, run, up, resume=args.resume)
