"""The lock that makes one live run the owner of its log_path (fleetrl.up.log_dir.lock_log_dir): a second start is
refused naming the owner's pid, whatever it asks (two at once: one wins), and nothing is deleted; the OS releases
the lock when the owner dies, however it ends, so a crashed run can be resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fleetrl import Config
from fleetrl.up.config import UpConfig
from fleetrl.up.log_dir import LOCK_FILE, LogDirError, lock_log_dir, lock_run_folders
from fleetrl.up.run import check_log_dir

HOLDER = """
import sys, time
from pathlib import Path
from fleetrl.up.log_dir import lock_log_dir
lock = lock_log_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def hold_in_child(log_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(log_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_lock_is_refused_naming_the_owner_and_freed_when_the_owner_is_killed(tmp_path):
    proc = hold_in_child(tmp_path / "run")
    try:
        with pytest.raises(LogDirError) as refused:
            lock_log_dir(tmp_path / "run")
        assert f"in use by a live run (`fleetrl up`, pid {proc.pid})" in str(refused.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = lock_log_dir(tmp_path / "run")  # a crashed run's folder: free again
    assert (tmp_path / "run" / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    lock.release()


def test_two_starts_at_once_one_wins(tmp_path):
    first = lock_log_dir(tmp_path)
    with pytest.raises(LogDirError, match=f"pid {os.getpid()}"):
        lock_log_dir(tmp_path)  # another open of the file: flock refuses it even in the same process
    first.release()
    lock_log_dir(tmp_path).release()


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}])
def test_any_start_on_a_live_runs_folder_is_refused_before_it_touches_a_file(tmp_path, flags):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("controller.sqlite", "metrics.jsonl", "trainer.log"):
        (run_dir / name).write_text("live\n")
    live = lock_log_dir(run_dir)
    cfg = Config(base_model="m", log_path=str(run_dir))
    up = UpConfig.from_dict({"rollout": "m:f"}, "test")
    with pytest.raises(LogDirError, match="in use by a live run"):
        check_log_dir(cfg, up, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    assert all((run_dir / n).read_text() == "live\n" for n in ("controller.sqlite", "metrics.jsonl", "trainer.log"))
    live.release()
    lock = check_log_dir(cfg, up, resume=False, overwrite=True)  # the run ended: it may be started over
    assert lock is not None and not (run_dir / "metrics.jsonl").exists()
    lock.release()


def test_a_crashed_runs_services_still_holding_the_lock_are_named_as_stopping(tmp_path):
    # The services inherit the lock; when `fleetrl up` itself died they hold it until they have stopped.
    script = HOLDER.replace("lock = lock_log_dir(Path(sys.argv[1]))", "")
    lock = lock_log_dir(tmp_path)
    os.set_inheritable(lock.fd, True)
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, pass_fds=(lock.fd,)
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        lock.release()
        os.truncate(tmp_path / LOCK_FILE, 0)
        (tmp_path / LOCK_FILE).write_text("999999999\n")  # an owner pid that is gone
        with pytest.raises(LogDirError, match="still stopping"):
            lock_log_dir(tmp_path)
    finally:
        child.kill()
        child.wait()
    lock_log_dir(tmp_path).release()


RUN_HOLDER = """
import sys, time
from fleetrl import Config
from fleetrl.up.config import UpConfig
from fleetrl.up.run import check_log_dir
lock = check_log_dir(Config(base_model="m", log_path=sys.argv[1]), UpConfig.from_dict({"rollout": "m:f"}, "t"),
                     resume=False, overwrite=True)
(__import__("pathlib").Path(sys.argv[1]) / "checkpoints" / "step-00000004").mkdir(parents=True)
print("locked", flush=True)
time.sleep(600)
"""


def start_live_run(log_dir):
    """A live run's folder lock, held by another process (`check_log_dir`, as `fleetrl up` takes it), with a
    checkpoint in its default checkpoint folder."""
    proc = subprocess.Popen([sys.executable, "-c", RUN_HOLDER, str(log_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.parametrize("flags", [{}, {"resume": True}, {"overwrite": True}])
@pytest.mark.parametrize("folder", ["checkpoints", "final", "."])
def test_a_run_naming_a_live_runs_checkpoint_or_output_folder_is_refused_naming_it_and_deletes_nothing(
    tmp_path, flags, folder
):
    # Issue 45: a run with --overwrite, its own log_path and the live run's --checkpoint-dir deleted the live run's
    # checkpoints, then both wrote into that folder. Its own log_path was free, so the lock let it through.
    live_dir = tmp_path / "live"
    live = start_live_run(live_dir)
    try:
        (live_dir / "final").mkdir(exist_ok=True)
        (live_dir / "final" / "config.json").write_text("{}")
        before = sorted(str(p.relative_to(live_dir)) for p in live_dir.rglob("*"))
        other_dir = tmp_path / "other"
        trainer_args = ["--checkpoint-dir", str(live_dir / folder)] if folder != "final" else []
        cfg = Config(
            base_model="m",
            log_path=str(other_dir),
            output_dir=str(live_dir / "final") if folder == "final" else None,
        )
        up = UpConfig.from_dict({"rollout": "m:f", "trainer_args": trainer_args}, "test")
        with pytest.raises(LogDirError) as refused:
            check_log_dir(cfg, up, resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
        message = str(refused.value)
        assert f"in use by a live run (`fleetrl up`, pid {live.pid}, log_path {live_dir.resolve()})" in message
        assert str(live_dir / folder) in message or str(live_dir) in message
        assert sorted(str(p.relative_to(live_dir)) for p in live_dir.rglob("*")) == before  # nothing deleted
        # All or nothing: the refused run holds no lock on its own log_path either.
        lock_log_dir(other_dir).release()
    finally:
        live.kill()
        live.wait()


def test_overwrite_empties_an_owned_folder_but_keeps_its_lock(tmp_path):
    cfg = Config(base_model="m", log_path=str(tmp_path / "run"))
    up = UpConfig.from_dict({"rollout": "m:f"}, "test")
    lock = check_log_dir(cfg, up, resume=False, overwrite=False)
    (tmp_path / "run" / "checkpoints" / "step-00000002").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    lock = check_log_dir(cfg, up, resume=False, overwrite=True)
    try:
        assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [LOCK_FILE]
        with pytest.raises(LogDirError, match="checkpoint folder"):  # still owned: the same lock file
            lock_run_folders(tmp_path / "elsewhere", {"the checkpoint folder": tmp_path / "run" / "checkpoints"})
    finally:
        lock.release()
    # A folder with only its lock holds no run: a plain start is fine.
    check_log_dir(cfg, up, resume=False, overwrite=True).release()
    check_log_dir(cfg, up, resume=False, overwrite=False).release()


def test_overwrite_never_deletes_a_folder_holding_a_live_runs_folders(tmp_path):
    # This run's checkpoint folder is the folder that holds the live run's log_path: --overwrite would empty it.
    live_dir = tmp_path / "runs" / "live"
    live = start_live_run(live_dir)
    try:
        before = sorted(str(p) for p in (tmp_path / "runs").rglob("*"))
        cfg = Config(base_model="m", log_path=str(tmp_path / "other"))
        up = UpConfig.from_dict({"rollout": "m:f", "trainer_args": ["--checkpoint-dir", str(tmp_path / "runs")]}, "t")
        with pytest.raises(LogDirError) as refused:
            check_log_dir(cfg, up, resume=False, overwrite=True)
        assert f"--overwrite would delete {live_dir.resolve()}" in str(refused.value)
        assert f"pid {live.pid}" in str(refused.value) and "nothing was deleted" in str(refused.value)
        after = sorted(str(p) for p in (tmp_path / "runs").rglob("*"))
        assert sorted({*before, str(tmp_path / "runs" / LOCK_FILE)}) == after  # only this run's own lock file
    finally:
        live.kill()
        live.wait()
