"""`fleetrl eval run.toml [--model PATH]`: run the run's evaluation hook on its held-out rows against one model.

    fleetrl eval examples/arithmetic/run.toml                                # the base model
    fleetrl eval examples/arithmetic/run.toml --model runs/arithmetic/final  # the promoted model of a run

A LoRA run's final/ is a PEFT adapter folder: its merged/ (export_merged = true) is served when there, else the
adapter is merged into its base model under <log_path>/eval/merged first.

Starts one inference replica (the `[up]` engine and `inference_args`) on the model, hands the evaluation function
(`[up] evaluation`) the same `RolloutSetup` a gateway would, with `eval_dataset`'s rows, and prints its metrics as
one JSON object (also written to `--out`). A judge pool (`[up] judge_model`) starts as under `fleetrl up` and reaches
the hook's rollouts as `setup.judge_sampler` / `judge_base_url`. No controller or trainer: nothing is trained.
Exit 0, or 2 on a bad config, 1 when the replica or the evaluation fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from fleetrl.config import Config, ConfigError
from fleetrl.model_path import ModelNotFoundError, check_model_path
from fleetrl.rollout import RolloutSetup, evaluation_call_shape, make_evaluation_rollout_fn
from fleetrl.up.config import load_run_and_up
from fleetrl.up.console import Startup
from fleetrl.up.supervisor import ServiceFailed, Supervisor, log_tail


async def evaluate_with(
    address: str,
    run: Config,
    evaluation: str,
    model: str,
    timeout_s: float,
    *,
    auth_token: str | None = None,
    rollout: str | None = None,
    judges: list[str] | None = None,
    judge_base_url: str | None = None,
    judge_model: str | None = None,
) -> dict[str, float]:
    """The evaluation hook's metrics for the model served at `address` (an inference replica). fleetrl's
    `evaluate(setup, rows)` gets eval_dataset's rows; the current cookbook's `evaluation_fn(step, rollout_fn)` gets
    step 0 and the rollout function the `rollout` factory builds (with evaluation=True). `judges` (HOST:PORT of each
    judge replica), `judge_base_url` and `judge_model`: the judge pool, on the setup as a gateway puts it."""
    from transformers import AutoTokenizer

    from fleetrl.controller.dataset import load_rows
    from fleetrl.gateway.sampler import Sampler
    from fleetrl.user_code import load_object

    evaluation_fn = load_object(evaluation)
    cookbook_shape = evaluation_call_shape(evaluation_fn) == "step_rollout_fn"
    rows = [] if cookbook_shape else load_rows(run.eval_dataset or "")
    check_model_path(run.tokenizer_model or model)
    tokenizer = AutoTokenizer.from_pretrained(run.tokenizer_model or model)
    sampler = Sampler(tokenizer, auth_token=auth_token, default_kwargs=run.sample_kwargs)
    sampler.set_replicas([address])
    setup = RolloutSetup.for_run(run, tokenizer, sampler)
    judge_sampler = None
    if judges:
        from fleetrl.gateway.judge import attach_judge_pool

        judge_tokenizer = AutoTokenizer.from_pretrained(judge_model) if judge_model else tokenizer
        judge_sampler = attach_judge_pool(
            setup, judges, judge_tokenizer, base_url=judge_base_url, model=judge_model, auth_token=auth_token
        )
    try:
        if cookbook_shape:
            if rollout is None:
                raise ValueError("evaluation_fn(step, rollout_fn) needs the run's rollout factory ([up] rollout)")
            rollout_fn = make_evaluation_rollout_fn(load_object(rollout)(setup))
            call = evaluation_fn(0, rollout_fn)
        else:
            call = evaluation_fn(setup, rows)
        metrics = await asyncio.wait_for(call, timeout=timeout_s)
    finally:
        await setup.sessions.close()  # the agent session server, if the hook's rollouts opened sessions
        await sampler.close()
        if judge_sampler is not None:
            await judge_sampler.close()
    return {str(k): float(v) for k, v in dict(metrics or {}).items()}


def judge_flags(flags: list[str]) -> dict[str, Any]:
    """`evaluate_with`'s judge arguments from the gateway flags `judge_gateway_flags` writes."""
    judges = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--judge"]
    named = {flag: flags[i + 1] for i, flag in enumerate(flags) if flag in ("--judge-base-url", "--judge-model")}
    return {
        "judges": judges,
        "judge_base_url": named.get("--judge-base-url"),
        "judge_model": named.get("--judge-model"),
    }


def servable_model(model: str, work_dir: Path, *, dtype: str = "float32") -> str:
    """An HF model folder a replica serves: `model` itself, or for a PEFT adapter folder its `merged/` (written by
    export_merged) or else the adapter merged into its base (adapter_config.json's base_model_name_or_path)
    at `work_dir/merged`."""
    folder = Path(model)
    if not (folder / "adapter_config.json").is_file():
        return model
    if (folder / "merged" / "config.json").is_file():
        return str(folder / "merged")
    from fleetrl.trainer.lora import merge_adapter

    print(f"fleetrl eval: {model} is a LoRA adapter; merging it into its base model", file=sys.stderr)
    return str(merge_adapter(folder, work_dir / "merged", dtype=dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="run.toml with eval_dataset in [run] and evaluation in [up]")
    parser.add_argument("--model", help="HF model folder to evaluate (default: run.base_model)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a run key")
    parser.add_argument("--out", type=Path, help="also write the metrics here as JSON")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the evaluation may take")
    args = parser.parse_args(argv)
    try:
        run, up, _ = load_run_and_up(args.config, args.set)
        model = args.model or run.base_model
        if not model:
            raise ConfigError("run.base_model: no model to evaluate (set it, or pass --model)")
        check_model_path(model, "--model" if args.model else "run.base_model")
        if not up.evaluation:
            raise ConfigError("up.evaluation: the config names no evaluation function")
        from fleetrl.up.run import evaluation_needs_rows, judge_gateway_flags, start_judges, user_spec

        if not run.eval_dataset and evaluation_needs_rows(up.evaluation, args.config.parent):
            raise ConfigError("run.eval_dataset: the config names no held-out rows")
        if up.judge_model is not None:
            check_model_path(up.judge_model, "up.judge_model")
    except (ConfigError, ModelNotFoundError) as exc:
        print(f"fleetrl eval: {exc}", file=sys.stderr)
        return 2

    try:
        model = servable_model(model, Path(run.log_path) / "eval", dtype=run.dtype)
    except (OSError, ValueError) as exc:
        print(f"fleetrl eval: --model {model}: {exc}", file=sys.stderr)
        return 1

    evaluation = user_spec(up.evaluation, args.config.parent)
    auth_token = up.auth_token or os.environ.get("FLEETRL_AUTH_TOKEN")
    env = {"PYTHONPATH": str(args.config.parent.resolve())}
    if auth_token:
        env["FLEETRL_AUTH_TOKEN"] = auth_token
    sup = Supervisor(Path(run.log_path) / "eval", env)
    inference_args = ["--model", model, "--engine", up.engine, "--grpc-port", "0", "--no-http", "--no-metrics"]
    try:
        replica = sup.start("inference", "inference", [*inference_args, *up.inference_args], env=up.replica_env(0))
        with Startup(1, sys.stderr, prefix="fleetrl eval") as startup:  # stdout is the metrics' JSON
            startup.waiting(replica.name)
            info = sup.wait_ready(replica, up.startup_timeout_s)
            startup.ready(replica)
        address = f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}"
        # The judge pool ([up] judge_model), started as fleetrl up starts it: the rollout's setup.judge_sampler.
        judge = judge_flags(judge_gateway_flags(up, start_judges(sup, run, up, None, stream=sys.stderr)))
        metrics: dict[str, Any] = asyncio.run(
            evaluate_with(
                address,
                run,
                evaluation,
                model,
                args.timeout,
                auth_token=auth_token,
                rollout=user_spec(up.rollout, args.config.parent),
                **judge,
            )
        )
    except ServiceFailed as exc:
        print(f"fleetrl eval: {exc}\n--- {exc.child.log_path} ---\n{log_tail(exc.child.log_path)}", file=sys.stderr)
        return 1
    except Exception as exc:  # the user's evaluation function, the rows file, a timeout: say which
        print(f"fleetrl eval: evaluation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        sup.stop_all()
    result = {"model": str(model), **metrics}
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
