"""`AutoSteps` (the trainer's --auto-steps coordinator): a step from the first P buffered groups in arrival order,
numbered after the steps done, until max_steps, then one finish; a failure is kept, not raised."""

from __future__ import annotations

import threading
from pathlib import Path

from fleetrl import RolloutSample
from fleetrl.rollout_group import RolloutGroup
from fleetrl.services.trainer.auto_steps import AutoSteps
from fleetrl.trainer.buffer import GroupBuffer, GroupRef


def group(row_id: int, lease_tag: int = 0) -> RolloutGroup:
    sample = RolloutSample([1, 2, 3], [0.0, -0.5, -0.5], [0, 1, 1], 1.0)
    return RolloutGroup(row_id, 0, [sample, sample], attempt=1, lease_tag=lease_tag)


class FakeService:
    """Trains by discarding the named rows, as the trainer service does."""

    def __init__(self, buffer: GroupBuffer, fail_at: int | None = None) -> None:
        self.buffer = buffer
        self.fail_at = fail_at
        self.steps: list[tuple[int, list[GroupRef]]] = []
        self.finished = 0

    def steps_done(self) -> int:
        return len(self.steps)

    def train_step(self, step: int, groups: list[GroupRef]) -> None:
        if step == self.fail_at:
            raise RuntimeError(f"step {step} broke")
        self.steps.append((step, groups))
        self.buffer.discard([ref[0] for ref in groups])

    def finish(self) -> tuple[Path, Path]:
        self.finished += 1
        return Path("ckpt"), Path("export")


def auto_steps(service: FakeService, max_steps: int | None, stop: threading.Event | None = None) -> AutoSteps:
    return AutoSteps(
        service.buffer,
        groups_per_step=2,
        max_steps=max_steps,
        steps_done=service.steps_done,
        train_step=service.train_step,
        finish=service.finish,
        stop=stop or threading.Event(),
    )


def test_steps_take_p_groups_in_arrival_order_until_max_steps_then_finish_once():
    buffer = GroupBuffer()
    for row_id, tag in [(7, 70), (3, 30), (9, 0), (1, 10), (5, 50)]:
        assert buffer.add(group(row_id, tag))
    service = FakeService(buffer)
    steps = auto_steps(service, max_steps=2)
    steps.run()  # returns at max_steps
    assert service.steps == [(1, [(7, 1, 70), (3, 1, 30)]), (2, [(9, 1, 0), (1, 1, 10)])]
    assert service.finished == 1 and steps.failed is None
    assert len(buffer) == 1  # the fifth group waits for a step that max_steps does not allow


def test_a_failed_step_is_kept_in_failed_and_ends_the_loop():
    buffer = GroupBuffer()
    for row_id in range(4):
        buffer.add(group(row_id))
    service = FakeService(buffer, fail_at=2)
    steps = auto_steps(service, max_steps=None)
    steps.run()
    assert isinstance(steps.failed, RuntimeError) and "step 2 broke" in str(steps.failed)
    assert [s for s, _ in service.steps] == [1] and service.finished == 0


def test_a_set_stop_flag_trains_nothing():
    buffer = GroupBuffer()
    for row_id in range(2):
        buffer.add(group(row_id))
    service = FakeService(buffer)
    stop = threading.Event()
    stop.set()
    steps = auto_steps(service, max_steps=None, stop=stop)
    steps.run()
    assert service.steps == [] and steps.failed is None
