"""Leases, heartbeats, liveness and stall detection run on the monotonic clock (issue 28, item 8): the wall clock
stepping forward by 2 h (NTP, a resumed VM, an operator) failed a run in under a second ("no live trainer
registered": every member looked dead and every lease expired).

A fresh interpreter makes the wall clock steppable before the controller is imported, builds the controller's parts
with their default clocks, steps the wall clock forward and looks at what the run loop would: the trainer alive,
the leases held, the gateway alive, no stall.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import asyncio, time
real_time = time.time
step = [0.0]
time.time = lambda: real_time() + step[0]   # before the controller is imported: its defaults see this clock

from fleetrl import Config
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.services.controller.orchestrator import Orchestrator
from fleetrl.services.controller.servicer import ControllerServicer
from fleetrl.v1 import controller_pb2

class Context:
    async def abort(self, code, details):
        raise AssertionError(details)

async def main():
    scheduler = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False), OffPolicyGate(2, 2, 0), prompt_groups_per_step=2
    )
    members = MemberRegistry(heartbeat_timeout_s=30)
    config = ControllerConfig(run=Config(), rows_path="rows.jsonl")
    orch = Orchestrator(config, scheduler, members, metrics_path="unused.jsonl")
    servicer = ControllerServicer(scheduler, members, orch, run_id="r", heartbeat_interval_s=2.0)
    members.register("trainer", "trainer", "127.0.0.1:1", servicer.clock())
    members.register("inference", "inference-0", "127.0.0.1:2", servicer.clock())
    orch.started = True
    reply = await servicer.LeaseRows(controller_pb2.LeaseRowsRequest(gateway_id="gw", max_rows=2), Context())
    assert len(reply.rows) == 2
    assert abs(reply.rows[0].lease_deadline_unix_s - (time.time() + scheduler.lease_timeout_s)) < 60  # wall, shown

    step[0] = 7200.0  # the wall clock jumps 2 h forward
    orch.trainer_stub()  # before: RunFailed("no live trainer registered")
    assert scheduler.expire(orch.clock()) == [], "leases expired by a wall-clock step"
    orch.release_dead_gateways()
    assert members.alive("gateway", orch.clock()), "the gateway was declared dead"
    orch.check_stalled()

asyncio.run(main())
print("OK")
"""


def test_a_wall_clock_step_moves_no_lease_liveness_or_stall_deadline(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
