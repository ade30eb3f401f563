"""`fleetrl up` end to end on the tiny model with the hf engine: synchronous, O=0 and O=2."""

from __future__ import annotations

import pytest

from fleetrl import metric_names as mn
from fleetrl.controller.journal import Journal
from tests.integration.up.conftest import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def check_ledger(run_dir, steps: int, groups_per_step: int) -> dict:
    rows = Journal(run_dir / "controller.sqlite").rows()
    trained = [r for r, info in rows.items() if info["status"] == "trained"]
    assert len(trained) == steps * groups_per_step
    for row_id, info in rows.items():
        # Every row the ledger knows was trained exactly once, or is explicitly closed, or was still queued when
        # max_steps ended the run; nothing is left leased or in limbo.
        assert info["status"] in ("trained", "rejected", "failed", "queued"), (row_id, info)
        assert info["trained_count"] == (1 if info["status"] == "trained" else 0)
    return rows


@pytest.mark.parametrize(
    ("mode", "run", "bound"),
    [
        ("sync", {"synchronous_training": True}, 0),
        ("o0", {"max_head_offpolicy_versions": 0}, 0),
        ("o2", {"max_head_offpolicy_versions": 2, "weight_sync_interval": 1}, 2),
    ],
)
def test_up_trains_within_the_offpolicy_bound(up_run, tmp_path, mode, run, bound):
    if mode == "o0":  # this run reads its rows from a Parquet dataset: one run checks both (issue 29 suite time)
        run = {**run, "dataset": str(parquet_rows(tmp_path, 24))}
    result, run_dir = up_run(run)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["async/version_offset_max"] <= bound
        assert 0.0 <= m["rollout/raw_reward"] <= 1.0
        assert "env/all/even_frac" in m and "perf/step_time" in m and "train/loss" in m
        # Every phase of the step is timed: the gateways' per-row phases and the push's fetch, swap, gate open.
        assert m["perf/rollout_time"] > 0 and m["perf/lease_time"] > 0 and m["perf/group_send_time"] > 0
        if bound == 0:  # serial pushes: the step's own push, awaited
            assert m["perf/weight_fetch_time"] > 0 and m["perf/weight_swap_time"] > 0
            assert m["perf/gate_open_time"] >= m["perf/weight_update_time"] > 0
            assert m["perf/push_wait_time"] == m["perf/weight_update_time"]
            assert m["perf/version_serve_time"] > 0
        else:  # overlapped (O >= 1): the step never waited for its push; it runs beside the next step
            assert m["perf/weight_update_time"] == 0.0 and m["perf/push_wait_time"] == 0.0
            assert m["async/versions_superseded"] >= 0
    if bound > 0:  # the run drained its pushes before it ended: the replica serves the last version
        assert "loaded version 3 from" in (run_dir / "controller.log").read_text()
    check_ledger(run_dir, steps=3, groups_per_step=2)
    assert (run_dir / "final" / "config.json").exists()  # the promoted model, exported by the trainer
    check_console(result.stdout, metrics, run_dir)


def check_console(stdout: str, metrics: list[dict], run_dir) -> None:
    """stdout is no terminal here: the services table (each service, its address and log), then one plain line
    per step with the numbers users watch, read from the step's metrics.jsonl line."""
    lines = stdout.splitlines()
    assert "fleetrl up: services" in stdout
    table = [line for line in lines if "│" in line]  # the table's rows (rich draws it, plain text off a terminal)
    for name in ("inference-0", "trainer", "controller", "gateway-0"):
        (row,) = [line for line in table if f" {name} " in line]
        assert str(run_dir / f"{name}.log") in row
        assert ("127.0.0.1:" in row) is (name != "gateway-0")  # gateways listen nowhere: they only call out
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == ["1/3", "2/3", "3/3"]
    for line, m in zip(step_lines, metrics, strict=True):
        assert line.split()[2] == f"v{m[mn.VERSION]}"
        assert f"reward {m[mn.RAW_REWARD]:.3f}" in line and f"loss {m[mn.LOSS]:.4g}" in line
        assert f"entropy {m[mn.ENTROPY]:.3f}" in line and " samples/s " in line and " eta " in line


@pytest.mark.vllm
@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["one-rank", "tensor-parallel-2"])
def test_up_trains_with_the_vllm_engine(up_run, tensor_parallel):
    # tensor_parallel 2: the replica's two vLLM ranks each hold half of every sharded layer (on CPU each rank's
    # threads get their own CPU: vllm_cpu_binds.py), and every pushed version lands in both shards.
    pytest.importorskip("vllm")
    up = {"engine": "vllm", "inference_args": ["--kv-cache-gib", "1", "--max-model-len", "128", "--no-http"]}
    up["inference_tensor_parallel_size"] = tensor_parallel
    result, run_dir = up_run({"max_head_offpolicy_versions": 1}, up, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["async/version_offset_max"] <= 1 for m in metrics)
    # Weights went to the vLLM replica in place: every push is logged with its pause.
    log = (run_dir / "inference-0.log").read_text()
    assert log.count("loaded weights version") >= 3
    assert f"tp {tensor_parallel}," in log
    check_ledger(run_dir, steps=3, groups_per_step=2)


def test_up_pushes_bfloat16_weights_to_bfloat16_replicas(up_run):
    # inference_dtype = bfloat16 on a float32 trainer: fleetrl up starts the replica in bfloat16 and the trainer
    # publishes bfloat16 (half the bytes). A replica refuses weights of another dtype than it serves, so every
    # version loading proves the cast.
    result, run_dir = up_run({"max_head_offpolicy_versions": 1, "inference_dtype": "bfloat16"})
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert [m["version"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "inference-0.log").read_text().count("loaded weights version") >= 3
    published = [line for line in (run_dir / "trainer.log").read_text().splitlines() if "published weights" in line]
    assert published
    check_ledger(run_dir, steps=3, groups_per_step=2)


def test_up_runs_a_two_rank_fsdp_trainer_under_torchrun(up_run):
    # trainer_procs = 2: torchrun, FSDP2 over gloo on CPU; rank 0 serves, rank 1 follows its commands.
    result, run_dir = up_run({"max_head_offpolicy_versions": 1, "dcp_save_interval": 2}, {"trainer_procs": 2})
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    trainer_log = (run_dir / "trainer.log").read_text()
    assert "torch.distributed.run" in trainer_log.splitlines()[0]
    assert "rank 1/2: process group up (gloo)" in trainer_log
    # Each version was published from the ranks' own shards, one tensor at a time (issue 39 item 2).
    assert "staged weights version 3: " in trainer_log and "gathered shard by shard" in trainer_log
    check_ledger(run_dir, steps=3, groups_per_step=2)
    assert (run_dir / "final" / "config.json").exists()  # exported from the sharded model


def test_up_with_replicas_that_never_get_weights(up_run):
    # weight_sync_interval = 0: the replicas keep the base weights, the gate follows the trainer's versions, and
    # stale samples are trained (stale_policy = "train"). A replica serving version 0 is not fenced for it.
    run = {"weight_sync_interval": 0, "stale_policy": "train", "max_head_offpolicy_versions": 1, "max_steps": 4}
    result, run_dir = up_run(run, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    assert max(m["async/version_offset_max"] for m in metrics) >= 2  # samples of version 0 trained at step 3+
    assert "loaded weights version" not in (run_dir / "inference-0.log").read_text()
    assert "fenced" not in (run_dir / "controller.log").read_text()
    check_ledger(run_dir, steps=4, groups_per_step=2)


def parquet_rows(tmp_path, n_rows: int):
    """The rows `write_run` writes as JSONL, as a Parquet file (`fleetrl up` reads either; the "o0" mode's run above
    reads this one)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"count {i} to {i + 3}:"} for i in range(n_rows)]), rows)
    return rows
