"""Rows dropped for being slow say so only when they were slow (issue 45, item 4). In the flood probe a genuine row
whose group the trainer had refused was lost, leased again, and then dropped "as too slow: stale on 3 attempts"
although only one attempt had come back stale: the limit counted every lease of the row. It counts stale attempts
now; a lost or failed attempt on the way is not slowness."""

from __future__ import annotations

import logging

from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.scheduler import RowScheduler


def test_a_lost_attempt_does_not_count_towards_the_stale_limit(caplog):
    s = RowScheduler(
        DatasetCursor([{"q": i} for i in range(8)], shuffle=False),
        OffPolicyGate(1, 2, 0),
        prompt_groups_per_step=1,
        max_attempts=5,
        max_stale_attempts=2,
    )
    (lease,) = s.lease("gw", 1, now=0)
    assert s.report(lease.row_id, "accepted", now=1, min_version=0, attempt=lease.attempt) == "accepted"
    assert s.groups_lost(s.take_step(), {lease.row_id}) == [lease.row_id]  # the trainer refused its group
    (again,) = s.lease("gw", 1, now=2)
    assert again.row_id == lease.row_id and again.attempt == 2
    with caplog.at_level(logging.WARNING):
        # Stale once in two attempts: leased again (before: dropped as "stale on 2 attempts").
        assert s.report(again.row_id, "accepted", now=3, min_version=-5, attempt=2) == "stale"
        (third,) = s.lease("gw", 1, now=4)
        assert third.row_id == lease.row_id and third.attempt == 3
        assert s.report(third.row_id, "accepted", now=5, min_version=-5, attempt=3) == "failed"
    assert s.counters["rows_failed_stale"] == 1
    assert "stale on 2 of its 3 attempts" in caplog.text and "slow, not wrong" in caplog.text
