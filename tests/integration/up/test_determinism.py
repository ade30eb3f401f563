"""Same seed, same weights: two synchronous `fleetrl up` runs end with the same model, and so does a run whose
trainer is killed mid-run and resumed from its last checkpoint.

What makes it hold (docs/ARCHITECTURE.md, "Determinism"): every sampling request of a rollout is seeded from (run
seed, row, version, sample index, call index), the trainer builds a step's batch in row order whatever order the
groups arrived in, and the hf replica decodes one sequence at a time (`--max-num-seqs 1`). The last is needed on
CPU: a sequence's logprobs move by ~1e-6 with whatever else shares its batch, and with batching on these runs
ended 1.3e-6 apart (two uninterrupted) and 6e-5 apart (resumed), against an update of 1.8e-3.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fleetrl.trainer.checkpoint import STATE_FILE, latest_checkpoint
from fleetrl.up.cpu_threads import REPRODUCIBLE_MATH_ENV
from fleetrl.up.preload import SOCKET_ENV
from tests.integration.up.conftest import (
    fleetrl_up,
    kill_trainer_after,
    read_metrics,
    write_run,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _ordinary_starts() -> Iterator[None]:
    """These runs start their services as new processes, as a user's `fleetrl up` does, not forked from the test
    session's preload server (tests/conftest.py): the guarantee checked here is the ordinary path's. (One CI run
    with forked services ended with a baseline 1.1e-5 away from two later runs that matched each other; forked
    and fresh runs matched exactly here, so the cause stayed unexplained: docs/testing.md.) The test session's
    settings of oneMKL's reproducibility variables (tests/conftest.py) are taken away too, so the ones these runs'
    services get are those `fleetrl up` itself gives (fleetrl/up/cpu_threads.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(SOCKET_ENV, raising=False)
        for key in REPRODUCIBLE_MATH_ENV:
            patch.delenv(key, raising=False)
        yield


STEPS = 6
# lr 3e-4 keeps the even-token reward below 1 for every step (at 1e-3 it saturates by step 4 and later steps
# train nothing, which would make the resumed steps trivially equal).
RUN = {"max_steps": STEPS, "synchronous_training": True, "dcp_save_interval": 1, "learning_rate": 3e-4}
UP = {"inference_args": ["--max-num-seqs", "1"]}


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def first_difference(a: Path, b: Path) -> str:
    """Where two runs' records part (for a failure message): the first step whose metrics differ, and how each
    run's services were started."""
    ma, mb = read_metrics(a), read_metrics(b)
    parted = "none of the steps' metrics differ"
    for x, y in zip(ma, mb, strict=False):
        differ = {
            k: (x[k], y.get(k))
            for k in x
            if isinstance(x[k], float) and x[k] != y.get(k) and not k.startswith("perf/") and k != "time"
        }
        if differ:
            parted = f"step {x['step']} differs first: {dict(list(differ.items())[:6])}"
            break

    def starts(run_dir: Path) -> list[str]:
        return sorted(
            f"{log.stem}: {'forked' if 'forked by the preload server' in log.read_text() else 'new process'}"
            for log in run_dir.glob("*.log")
        )

    return f"{parted}; services: {starts(a)} vs {starts(b)}; {cpu()}"


def cpu() -> str:
    """The machine, for a failure message: whether its CPUs are cores or hyperthreads matters to MKL's threading."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu: unknown"
    fields = [line.split(":", 1) for line in info.splitlines() if ":" in line]
    model = next((v.strip() for k, v in fields if k.strip() == "model name"), "?")
    per_core = sorted({f"{k.strip()} {v.strip()}" for k, v in fields if k.strip() in ("siblings", "cpu cores")})
    return f"cpu: {model}, {sum(k.strip() == 'processor' for k, _ in fields)} processors, {per_core}"


def math_environment(pid: int) -> dict[str, str]:
    """The oneMKL/OpenMP reproducibility variables in a live process's environment."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)
    return {k: pairs[k] for k in REPRODUCIBLE_MATH_ENV if k in pairs}


def steps_done(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["steps_done"])


def run_to_the_end(tmp_path: Path, model_dir: str) -> Path:
    config = write_run(tmp_path, model_dir, RUN, UP)
    result = fleetrl_up(config)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["optim/grad_norm"] > 0 and m["data/groups_skipped"] == 0 for m in metrics)  # every step updates
    return tmp_path / "run"


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Path:
    """One uninterrupted run (shared by the tests of this module)."""
    return run_to_the_end(tmp_path_factory.mktemp("baseline"), tiny_model_dir)


@pytest.fixture(scope="module")
def baseline(baseline_run: Path) -> dict:
    """The final weights of the uninterrupted run."""
    return final_weights(baseline_run)


def test_two_runs_with_the_same_seed_end_with_the_same_weights(baseline, baseline_run, tmp_path, tiny_model_dir):
    run_dir = run_to_the_end(tmp_path, tiny_model_dir)
    base = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    # The runs trained (the weights moved by far more than the tolerance) and ended at the same place.
    assert max_difference({k: v for k, v in baseline.items() if k in base}, base) > 5e-4
    assert max_difference(final_weights(run_dir), baseline) <= 1e-6, first_difference(baseline_run, run_dir)


def test_a_killed_and_resumed_run_ends_with_the_uninterrupted_weights(baseline, baseline_run, tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, RUN, UP)
    run_dir = tmp_path / "run"
    seen: dict[str, str] = {}
    assert kill_trainer_after(config, run_dir, 3, before_kill=lambda pid: seen.update(math_environment(pid))) == 1
    assert seen == REPRODUCIBLE_MATH_ENV  # given by `fleetrl up` (the test took the session's away)
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None
    saved = steps_done(checkpoint)
    assert 3 <= saved < STEPS  # killed mid-run: the resumed run has steps left to train

    resumed = fleetrl_up(config, extra=["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at version {saved}" in (run_dir / "controller.log").read_text()
    assert steps_done(latest_checkpoint(run_dir / "checkpoints")) == STEPS
    assert max_difference(final_weights(run_dir), baseline) <= 1e-5, first_difference(baseline_run, run_dir)
