"""A run where nothing moves fails after `stall_timeout_s`, saying what the pipeline looks like."""

import pytest

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator, RunFailed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run_with_one_fenced_replica(
    tmp_path, clock: Clock, *, stall_timeout_s: float, heartbeat_s: float
) -> tuple[Orchestrator, RowScheduler, MemberRegistry]:
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 1), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=heartbeat_s)
    members.register("inference", "inference-0", "127.0.0.1:1", clock.now)
    members.fence("inference-0", "serves version 0")
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl", stall_timeout_s=stall_timeout_s)
    orch = Orchestrator(config, scheduler, members, metrics_path=tmp_path / "m.jsonl", clock=clock)
    return orch, scheduler, members


def test_no_progress_for_stall_timeout_fails_the_run(tmp_path):
    clock = Clock()
    orch, scheduler, members = _run_with_one_fenced_replica(tmp_path, clock, stall_timeout_s=60, heartbeat_s=30)
    scheduler.lease("gw", 1, now=clock.now)
    clock.now += 59
    orch.check_stalled()  # within the timeout: nothing happens
    orch.rows_reported(1, clock.now)  # a row was reported
    clock.now += 61
    members.heartbeat("inference-0", clock.now)  # alive, but fenced: no rollout can be routed
    with pytest.raises(RunFailed) as failed:
        orch.check_stalled()
    message = str(failed.value)
    assert "no row reported and no step trained for 61 s" in message
    assert "0 of 1 live replicas routable" in message and "1 rows leased" in message


def test_a_stalled_run_is_warned_about_every_half_minute_long_before_it_fails(tmp_path, caplog):
    """Before, nothing was logged between the fencing of a run's only replica and the stall timeout (30 min by
    default): the run looked alive. Now the liveness logger (which `fleetrl up` copies to its console) warns every
    STALL_WARN_S with the pipeline's picture, and says nothing again once rows are reported."""
    from fleetrl.services.controller.orchestrator import STALL_WARN_S

    clock = Clock()
    orch, _, _ = _run_with_one_fenced_replica(tmp_path, clock, stall_timeout_s=1800, heartbeat_s=10_000)
    orch.rows_reported(0, clock.now)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "fleetrl.controller.liveness"]

    with caplog.at_level("WARNING", logger="fleetrl.controller.liveness"):
        clock.now += STALL_WARN_S - 1
        orch.check_stalled()
        assert warnings() == []
        for _ in range(4):  # 4 checks in the next half minute: one warning
            clock.now += STALL_WARN_S / 4
            orch.check_stalled()
        assert len(warnings()) == 1
        assert "no row reported and no step trained for 36 s" in warnings()[0]  # 29 + 7.5
        assert "0 of 1 live replicas routable" in warnings()[0]
        clock.now += STALL_WARN_S
        orch.check_stalled()
        assert len(warnings()) == 2
        orch.rows_reported(1, clock.now)  # progress: quiet again
        clock.now += STALL_WARN_S - 1
        orch.check_stalled()
        assert len(warnings()) == 2
