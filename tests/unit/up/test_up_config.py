import json
import sys

import pytest

from fleetrl.config import ConfigError
from fleetrl.up.config import UpConfig
from fleetrl.up.supervisor import Supervisor


def write(tmp_path, up):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {}, "up": {"rollout": "m:f", **up}}))
    return path


def test_gpu_layout_sets_each_child_cuda_visible_devices(tmp_path):
    up = UpConfig.from_file(
        write(tmp_path, {"replicas": 2, "inference_gpus": [[0, 1], [2]], "trainer_procs": 2, "trainer_gpus": [3, 4]})
    )
    assert up.replica_env(0) == {"CUDA_VISIBLE_DEVICES": "0,1"} and up.replica_env(1) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert up.trainer_env() == {"CUDA_VISIBLE_DEVICES": "3,4"}
    plain = UpConfig.from_file(write(tmp_path, {}))
    assert plain.trainer_env() == {} and plain.replica_env(0) == {}


def test_replicas_on_gpus_serve_with_vllm_unless_the_engine_is_given(tmp_path):
    assert UpConfig.from_file(write(tmp_path, {"inference_gpus": [[0]]})).engine == "vllm"
    assert UpConfig.from_file(write(tmp_path, {"inference_gpus": [[0]], "engine": "hf"})).engine == "hf"
    assert UpConfig.from_file(write(tmp_path, {})).engine == "hf"


@pytest.mark.parametrize(
    ("up", "message"),
    [
        ({"trainer_procs": 2, "trainer_gpus": [0]}, "trainer_gpus has 1 GPUs but trainer_procs is 2"),
        ({"replicas": 2, "inference_gpus": [[0]]}, "inference_gpus has 1 lists but replicas is 2"),
        (
            {"replicas": 2, "inference_gpus": [[0], [1]], "trainer_procs": 2, "trainer_gpus": [1, 2]},
            "trainer_gpus and inference_gpus overlap on GPU 1",
        ),
        ({"trainer_procs": 2, "trainer_gpus": [3, 3]}, "trainer_gpus lists GPU 3 twice"),
        ({"trainer_procs": 0}, "up.trainer_procs: Input should be greater than or equal to 1"),
        ({"max_replica_restarts": -1}, "up.max_replica_restarts: Input should be greater than or equal to 0"),
    ],
)
def test_bad_layout_fails_at_start_naming_the_field(tmp_path, up, message):
    with pytest.raises(ConfigError, match=message):
        UpConfig.from_file(write(tmp_path, up))


def test_supervisor_runs_a_multi_rank_service_under_torchrun(tmp_path, monkeypatch):
    started = []

    class FakePopen:  # records the command line; no process is started
        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs["env"]))
            self.pid = 0

    monkeypatch.setattr("fleetrl.up.supervisor.subprocess.Popen", FakePopen)
    sup = Supervisor(tmp_path, {"A": "1"})
    sup.start("trainer", "trainer", ["--x"], ready=False, env={"CUDA_VISIBLE_DEVICES": "2,3"}, nproc=2)
    sup.start("gateway-0", "gateway", ["--y"], ready=False)
    (argv, env), (plain_argv, plain_env) = started
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert argv == [*torchrun, "-m", "fleetrl", "serve", "trainer", "--x"]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["A"] == "1"
    assert plain_argv == [sys.executable, "-m", "fleetrl", "serve", "gateway", "--y"]
    assert plain_env.get("CUDA_VISIBLE_DEVICES") != "2,3"


def test_fleetrl_up_refuses_an_evaluation_without_held_out_rows(tmp_path, capsys):
    from fleetrl.up.run import main

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"run": {"base_model": "m"}, "up": {"rollout": "m:f", "evaluation": "m:evaluate"}}))
    assert main([str(path)]) == 2  # before any process starts
    assert "run.eval_dataset: [up] evaluation is set" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cpus", "procs", "replicas", "reference", "expected"),
    [
        (2, 1, 1, False, (1, 1, 1)),  # this machine: one core each
        (16, 1, 1, False, (8, 8, 8)),
        (16, 2, 2, True, (4, 2, 2)),  # trainer half over 2 ranks; replicas and reference share the other half
        (8, 1, 0, False, (8, 1, 1)),  # vLLM replicas only: the trainer takes every core
        (1, 1, 1, True, (1, 1, 1)),  # never below one thread
    ],
)
def test_cpu_threads_are_shared_between_compute_services(cpus, procs, replicas, reference, expected):
    from fleetrl.up.cpu_threads import plan_threads

    plan = plan_threads(cpus, trainer_procs=procs, hf_replicas=replicas, reference=reference)
    assert (plan.trainer, plan.inference, plan.reference) == expected and plan.light == 1
    assert plan.env("trainer") == {"OMP_NUM_THREADS": str(expected[0])}
    assert plan.env("light") == {"OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    ("cpus", "procs", "replicas", "reference", "expected"),
    [
        (2, 1, 1, False, (2, 1, 1)),  # O = 0: training and sampling take turns, the trainer gets both cores
        (16, 2, 1, False, (8, 8, 8)),
        (2, 1, 1, True, (1, 1, 1)),  # the reference scores groups while rollouts run: shared as before
    ],
)
def test_a_strictly_on_policy_trainer_gets_every_core(cpus, procs, replicas, reference, expected):
    from fleetrl.up.cpu_threads import plan_threads

    plan = plan_threads(cpus, trainer_procs=procs, hf_replicas=replicas, reference=reference, on_policy=True)
    assert (plan.trainer, plan.inference, plan.reference) == expected


def test_fleetrl_up_asks_no_held_out_rows_of_a_cookbook_shaped_evaluation(tmp_path, capsys):
    """The current cookbook's evaluation_fn(step, rollout_fn) owns its rows: no eval_dataset asked for; a hook
    whose shape cannot be read is refused naming it."""
    from fleetrl.up.run import main

    (tmp_path / "hooks.py").write_text(
        "async def evaluation_fn(step, rollout_fn):\n    return {}\n\nasync def unclear(a, b):\n    return {}\n"
    )
    path = tmp_path / "run.json"
    up = {"rollout": "m:f", "evaluation": "hooks.py:evaluation_fn"}
    run = {"base_model": "m", "dataset": str(tmp_path / "missing.jsonl")}
    path.write_text(json.dumps({"run": run, "up": up}))
    assert main([str(path)]) == 2  # refused one check later, for the missing dataset: not for held-out rows
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "eval_dataset" not in err
    path.write_text(json.dumps({"run": run, "up": {**up, "evaluation": "hooks.py:unclear"}}))
    assert main([str(path)]) == 2
    assert "up.evaluation: evaluation_fn: cannot tell from its parameters (a, b)" in capsys.readouterr().err


def test_up_gives_oneMKLs_reproducibility_variables_unless_the_user_set_them():
    from fleetrl.up.cpu_threads import REPRODUCIBLE_MATH_ENV, reproducible_math_env

    assert reproducible_math_env({}) == {"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE", "MKL_CBWR": "AUTO"}
    assert reproducible_math_env({"MKL_CBWR": "COMPATIBLE", "PATH": "/bin"}) == {
        k: v for k, v in REPRODUCIBLE_MATH_ENV.items() if k != "MKL_CBWR"
    }
