"""`fleetrl.main()` runs its gateways in the calling process, so the cookbook's Python objects work: a rollout
factory that is a closure over local state, a lambda as the dynamic filter and a local function as the evaluation
hook train a run; an in-process gateway's fatal error (a rollout returning an unknown type) still fails it, and a
crashed one (two gateways, the factory raising once) is replaced by a fresh task; a sidecar `main()` with a closure
(`controller_address=`) joins a run `fleetrl up` started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.up.conftest import REPO, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """
import json, sys
from fleetrl import Config, RolloutSample, main


def train(cfg, rows, mode):
    seen = {"rollouts": 0, "filtered": [], "evaluated": 0, "factories": 0}  # local state the closures update

    def make_rollout_fn(setup):
        seen["factories"] += 1
        if mode == "crash_once" and seen["factories"] == 1:
            raise RuntimeError("the factory fails once")  # the first gateway crashes; its replacement works

        async def rollout_fn(row):
            seen["rollouts"] += 1
            prompt = setup.tokenizer.encode(row["prompt"])
            (c,) = await setup.sampler.sample_with_prompt_tokens(prompt, n=1, **setup.sample_kwargs)
            if mode == "dict":
                return {"tokens": c.full_tokens, "reward": 1.0}  # not a RolloutSample: stops the run
            n = len(c.inference_logprobs)
            reward = sum(1 for t in c.completion_tokens if t % 2 == 0) / max(n, 1)
            return RolloutSample(
                c.full_tokens, [0.0] * c.prompt_len + c.inference_logprobs, [0] * c.prompt_len + [1] * n, reward
            )

        return rollout_fn

    async def evaluate(setup, eval_rows):
        seen["evaluated"] += 1
        return {"rows": float(len(eval_rows))}

    summary = main(
        cfg,
        rollout_fn_factory=make_rollout_fn,
        rows=rows,
        dynamic_filter_fn=lambda pg: seen["filtered"].append(len(pg.rewards)) is None,  # keeps every group
        evaluation_fn=evaluate,
        engine="hf",
        startup_timeout_s=240,
        gateways=2 if mode == "crash_once" else 1,
    )
    return {**summary, "rollouts": seen["rollouts"], "filtered": seen["filtered"], "evaluated": seen["evaluated"]}


if __name__ == "__main__":
    cfg = Config(**json.loads(sys.argv[1]))
    rows = [{"prompt": f"count {i} to {i + 3}:"} for i in range(8)]
    result = train(cfg, rows, sys.argv[2])
    print("RESULT " + json.dumps(result))
    sys.exit(result["exit_code"])
"""


def run_script(tmp_path, tiny_model_dir, mode: str) -> tuple[subprocess.CompletedProcess[str], dict, object]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    eval_rows = tmp_path / "eval.jsonl"
    eval_rows.write_text("".join(json.dumps({"prompt": f"count {i} to {i + 2}:"}) + "\n" for i in range(3)))
    run_dir = tmp_path / "run"
    cfg = {
        "base_model": tiny_model_dir,
        "log_path": str(run_dir),
        "eval_dataset": str(eval_rows),
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "learning_rate": 1e-3,
        "kl_beta": 0.0,
        "max_steps": 2,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, str(script), json.dumps(cfg), mode]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {}
    return proc, result, run_dir


def test_closures_lambdas_and_local_functions_train_a_run(tmp_path, tiny_model_dir):
    proc, result, run_dir = run_script(tmp_path, tiny_model_dir, "train")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert result["exit_code"] == 0 and result["steps"] == 2 and result["final_version"] == 2, result
    assert result["rollouts"] >= 2 * 2 * 4  # the closure ran in this process: its counter moved
    assert len(result["filtered"]) >= 2 and set(result["filtered"]) == {4}  # the lambda saw each group of 4
    assert result["evaluated"] >= 1
    evals = [m for m in read_metrics(run_dir) if "eval/rows" in m]
    assert evals and all(m["eval/rows"] == 3.0 for m in evals)  # the local hook's metrics reached the run
    assert not (run_dir / "gateway-0.log").exists()  # no gateway process was started
    assert "gateway gateway-" in (run_dir / "gateway.log").read_text()


def test_an_in_process_gateways_fatal_error_fails_the_run(tmp_path, tiny_model_dir):
    proc, result, _ = run_script(tmp_path, tiny_model_dir, "dict")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert result["exit_code"] == 1 and result["steps"] == 0, result
    assert "returned a type that is not a RolloutSample" in proc.stderr
    assert "the rollout function returned builtins.dict" in proc.stderr  # the in-process gateway's log tail
    assert "starting gateway-r1" not in proc.stderr  # not restarted: it would fail the same way


def test_a_crashed_in_process_gateway_is_replaced_and_the_run_trains(tmp_path, tiny_model_dir):
    proc, result, run_dir = run_script(tmp_path, tiny_model_dir, "crash_once")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert result["exit_code"] == 0 and result["steps"] == 2, result
    assert "exited with 1; starting gateway-r1" in proc.stderr
    log = (run_dir / "gateway.log").read_text()
    assert "RuntimeError: the factory fails once" in log and "crashed" in log


SIDECAR = """
import json, sys
from fleetrl import Config, main

if __name__ == "__main__":
    cfg = Config(**json.loads(sys.argv[1]))
    calls = []  # local state: the in-process sidecar gateway's closure fills it

    def make_rollout_fn(setup):
        async def rollout_fn(row):
            from pathlib import Path

            from tests.integration.up.rollouts import make_rollout_fn as inner

            calls.append(row["prompt"])
            sample = await inner(setup)(row)
            Path(sys.argv[4]).unlink(missing_ok=True)  # the main run's rollouts wait until the sidecar ran one
            return sample

        return rollout_fn

    summary = main(cfg, rollout_fn_factory=make_rollout_fn, controller_address=sys.argv[2], auth_token=sys.argv[3])
    print("RESULT " + json.dumps({**summary, "rollouts": len(calls)}))
    sys.exit(summary["exit_code"])
"""


def test_a_sidecar_main_with_a_closure_joins_a_running_run(tmp_path, tiny_model_dir):
    from fleetrl.ready_file import wait_ready_file
    from fleetrl.up.auth import read_run_token
    from tests.integration.up.conftest import start_fleetrl_up, write_run

    # The main run's rollouts wait while `hold` exists, and the sidecar's first rollout removes it: the run cannot
    # finish before the sidecar joined (it once finished in 6 s, and the sidecar then waited for a gone controller).
    hold = tmp_path / "hold"
    hold.touch()
    run = {"max_steps": 6, "rollout_extras": {"hold_file": str(hold)}}
    held = "tests.integration.up.rollouts:make_held_rollout_fn"
    up = {"rollout": held, "gateway_args": ["--max-rows-in-flight", "1"]}  # rows left for the sidecar
    config = write_run(tmp_path, tiny_model_dir, run, up, n_rows=24)
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        controller = wait_ready_file(run_dir / "ready" / "controller.json", 300, proc)
        token = read_run_token(run_dir)
        sidecar_cfg = {**json.loads(config.read_text())["run"], "log_path": str(tmp_path / "sidecar")}
        script = tmp_path / "sidecar.py"
        script.write_text(SIDECAR)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        address = f"{controller.get('host', '127.0.0.1')}:{controller['grpc_port']}"
        argv = [sys.executable, str(script), json.dumps(sidecar_cfg), address, token or "", str(hold)]
        sidecar = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert sidecar.returncode == 0, sidecar.stdout[-2000:] + sidecar.stderr[-3000:]
    lines = [line for line in sidecar.stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(lines[-1].removeprefix("RESULT "))["rollouts"] > 0  # the sidecar's closure ran rollouts
    assert len(read_metrics(run_dir)) == 6
    # Joining the run now that it has finished: refused soon, saying so (before: its gateway waited 120 s for the
    # gone controller, then was restarted again and again).
    late = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert late.returncode == 1, late.stdout[-2000:] + late.stderr[-3000:]
    assert f"no run answers at {address}" in late.stderr and "it finished, or is gone" in late.stderr
