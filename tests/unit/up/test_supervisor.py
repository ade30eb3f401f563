import subprocess
import sys

import pytest

from fleetrl.up.supervisor import Child, Supervisor
from tests.waiting import wait_until

# A child that, on SIGTERM, records which of the run's children (pids.txt) are still alive, then exits.
SCRIPT = """
import os, signal, sys, time
name, workdir = sys.argv[1], sys.argv[2]
def stop(*_):
    alive = []
    for line in open(os.path.join(workdir, "pids.txt")).read().split():
        kind, pid = line.split("=")
        try:
            os.kill(int(pid), 0)
            alive.append(kind)
        except ProcessLookupError:
            pass
    with open(os.path.join(workdir, "stops.txt"), "a") as fh:
        fh.write(name + " " + ",".join(alive) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(workdir, name + ".up"), "w").close()
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize(
    "kinds",
    [
        ["gateway", "inference", "trainer", "controller"],  # fleetrl up: gateway processes start with the stack
        ["inference", "trainer", "controller", "gateway"],  # gateways after the controller (in-process, attached)
    ],
)
def test_stop_all_stops_one_kind_at_a_time_gateways_first(tmp_path, kinds):
    sup = Supervisor(tmp_path)
    for kind in kinds:
        argv = [sys.executable, "-c", SCRIPT, kind, str(tmp_path)]
        process = subprocess.Popen(argv, start_new_session=True)
        sup.children.append(Child(kind, kind, argv, tmp_path / f"{kind}.log", process))
    (tmp_path / "pids.txt").write_text(" ".join(f"{c.kind}={c.pid}" for c in sup.children))
    wait_until(lambda: all((tmp_path / f"{k}.up").exists() for k in kinds), 60, "every child's SIGTERM handler")
    sup.stop_all(grace_s=30)
    stops = [line.split(" ") for line in (tmp_path / "stops.txt").read_text().splitlines()]
    assert [name for name, _ in stops] == ["gateway", "controller", "trainer", "inference"]
    alive_at_stop = {name: alive.split(",") for name, alive in stops}
    # The trainer was told to stop after the controller had exited, while the replica still served.
    assert alive_at_stop["trainer"] == ["inference", "trainer"]
    assert alive_at_stop["controller"] == ["inference", "trainer", "controller"]
    assert all(c.poll() == 0 for c in sup.children)


def test_a_crashed_replica_restarts_with_its_flags_on_new_ports_and_rejoins_under_its_member_id(tmp_path):
    from fleetrl.up.run import restart_replica

    class RecordingSupervisor:
        def __init__(self) -> None:
            self.started: list[tuple] = []

        def start(self, name, kind, args, ready=True, *, env=None, nproc=1):
            self.started.append((name, kind, args, env))
            argv = [sys.executable, "-m", "fleetrl", "serve", kind, *args, "--ready-file", f"r/{name}.json"]
            return Child(name, kind, argv, tmp_path / f"{name}.log", crashed, env=dict(env or {}))

    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(9)"])
    crashed.wait()
    flags = ["--model", "/m", "--grpc-port", "0", "--seed", "1"]
    argv = [sys.executable, "-m", "fleetrl", "serve", "inference", *flags, "--ready-file", "r/inference-1.json"]
    first = Child("inference-1", "inference", argv, tmp_path / "i.log", crashed, env={"OMP_NUM_THREADS": "1"})
    sup = RecordingSupervisor()
    second = restart_replica(sup, first, "127.0.0.1:7000", 1)
    restart_replica(sup, second, "127.0.0.1:7000", 2)  # it crashed again
    joined = ["--controller", "127.0.0.1:7000", "--member-id", "inference-1"]
    assert sup.started == [
        ("inference-1-r1", "inference", [*flags, *joined], {"OMP_NUM_THREADS": "1"}),
        ("inference-1-r2", "inference", [*flags, *joined], {"OMP_NUM_THREADS": "1"}),
    ]


def test_the_controller_gets_no_patience_once_the_trainer_has_crashed(tmp_path):
    # With a dead trainer the controller's step in flight (or its weight push, fetched from the dead trainer) can
    # only wait out its timeout: fleetrl up hung for minutes after a trainer crash.
    from fleetrl.up.run import stop_patience

    def child(kind: str, code: str) -> Child:
        process = subprocess.Popen([sys.executable, "-c", code])
        return Child(kind, kind, [], tmp_path / f"{kind}.log", process)

    trainer = child("trainer", "import time; time.sleep(60)")
    controller = child("controller", "import time; time.sleep(60)")
    try:
        assert stop_patience([trainer, controller], 300.0) == {"trainer": 300.0, "controller": 300.0}
        trainer.process.kill()
        trainer.process.wait(timeout=30)
        assert stop_patience([trainer, controller], 300.0) == {"trainer": 300.0}
    finally:
        for c in (trainer, controller):
            c.process.kill()
            c.process.wait(timeout=30)


# A service that starts a process of its own (as vLLM starts its engine core), writes its pid, then waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_service_leaves_no_process_of_its_own_behind(tmp_path):
    """A replica killed by SIGKILL (the OOM killer, a kill test) used to leave vLLM's engine core and workers
    running as orphans (1.7 GB each here), holding the run folder's lock descriptor. The supervisor reaps its group."""
    sup = Supervisor(tmp_path)
    pid_file = tmp_path / "grandchild.pid"
    argv = [sys.executable, "-c", PARENT, str(pid_file)]
    child = Child("inference-0", "inference", argv, tmp_path / "i.log", subprocess.Popen(argv, start_new_session=True))
    sup.children.append(child)
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60, "the service's own process")
    grandchild = int(pid_file.read_text())
    with pytest.raises(ValueError, match="still running"):
        sup.reap(child)
    child.process.kill()
    child.process.wait(timeout=30)
    assert _alive(grandchild)  # the orphan outlives the service killed by SIGKILL
    sup.reap(child)
    wait_until(lambda: not _alive(grandchild), 30, "the orphan to be killed")
    sup.reap(child)  # again: a no-op (the pid may since name another process's group)
    sup.stop_all(grace_s=5)
