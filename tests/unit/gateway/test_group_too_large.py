"""A group whose message is over the trainer's max_group_mb is refused at the gateway, loudly, before sending (issue
28, item 6): the trainer's socket drops such a frame without a word (ZMQ_MAXMSGSIZE), and its step then waited for
the group until the run failed ("groups of rows [...] did not arrive"). The row is reported REJECTED with the reason
and how to fix it, and closed.

A real gRPC controller stand-in; the group's two samples of 100k tokens each make a message of about 2 MiB, over a
1 MiB cap.
"""

from __future__ import annotations

import asyncio
import json

from fleetrl import RolloutSample
from fleetrl.controller.run_outcome import rejection_cause
from fleetrl.v1 import controller_pb2
from tests.unit.gateway.test_lease_wait import Controller, run_against

TOKENS = 100_000


class Recording(Controller):
    def __init__(self) -> None:
        super().__init__()
        self.reports: list[controller_pb2.RowReport] = []

    async def LeaseRows(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            row = controller_pb2.LeasedRow(row_id=0, submit_version=0, row_json=json.dumps({"q": 1}), attempt=1)
            return controller_pb2.LeaseRowsResponse(
                rows=[row], replicas=[controller_pb2.Replica(address="x:1")], groups_address="tcp://127.0.0.1:1"
            )
        await asyncio.wait_for(self.reported.wait(), 10.0)
        self.told.set()
        return controller_pb2.LeaseRowsResponse(run_finished=True, retry_after_s=0.2)

    async def ReportRows(self, request, context):
        self.reports.extend(request.reports)
        self.reported.set()
        return controller_pb2.ReportRowsResponse(results=["rejected"])


def make_huge_rollout_fn(setup):
    async def rollout(row):
        return RolloutSample(
            tokens=[1] * TOKENS,
            logprobs=[-0.5] * TOKENS,
            loss_mask=[0] + [1] * (TOKENS - 1),
            reward=float(len(row)),
            versions=[0] * TOKENS,
        )

    return rollout


async def test_a_group_over_the_trainers_cap_is_rejected_before_sending(caplog):
    controller = Recording()
    gateway = await run_against(controller, make_huge_rollout_fn, lease_wait_s=0.5, max_group_mb=1)
    (report,) = controller.reports
    assert report.outcome == controller_pb2.REJECTED  # before: sent, dropped by the trainer's socket unseen
    assert "over the trainer's max_group_mb (1 MiB)" in report.reason and "max_seq_len" in report.reason
    assert gateway.counters["groups_too_large"] == 1
    assert "group too large" in caplog.text
    assert rejection_cause(dict(report.samples_dropped), report.reason) == "too_large_group"
