"""The controller's run loop: hand complete steps to the trainer, push each new version to every replica,
open the gate once it is live, and write one metrics line per step (to metrics.jsonl and the run's trackers,
fleetrl.trackers), with the step's logged samples.

It never reaches into gateways: they pull rows and report outcomes through the gRPC servicer, which shares the
scheduler and registry with this loop on one asyncio event loop (so no locks are needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc

from fleetrl import metric_names as mn
from fleetrl.controller.fleet import FORGET_AFTER_TIMEOUTS, GONE_CODE_NAMES, Load, ReplicaFleet
from fleetrl.controller.lease_signal import LeaseSignal
from fleetrl.controller.liveness import OverdueCall, SilentLeaseHolders, watch_call
from fleetrl.controller.liveness import log as liveness_log
from fleetrl.controller.members import Member, MemberRegistry
from fleetrl.controller.mixture import MixtureCursor, RowRewards
from fleetrl.controller.push_plan import PushSource
from fleetrl.controller.push_queue import PushJob, PushQueue
from fleetrl.controller.row_phases import RowPhases
from fleetrl.controller.run_outcome import untrained_run_message
from fleetrl.controller.scheduler import RowScheduler, StepAssignment
from fleetrl.controller.step_line import StepTimes, step_line
from fleetrl.controller.step_recovery import cut_torn_tail, recovered_line, steps_in_samples, steps_to_recover
from fleetrl.controller.step_sums import StepSums
from fleetrl.metrics_jsonl import SUPERSEDED, cut_to_version, one_per_step, read_lines, steps_without_update
from fleetrl.rpc import open_channel
from fleetrl.sample_log import LoggedSample
from fleetrl.seq_len import resolve_max_seq_len
from fleetrl.services.controller.config import ControllerConfig
from fleetrl.step_metrics import done_fraction
from fleetrl.trackers import TrackerSet
from fleetrl.trackers.jsonl import SAMPLES_FILE, JsonlTracker
from fleetrl.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from fleetrl.weights.engine_sync import EnginePushCounts
from fleetrl.weights.timeouts import push_deadline_s

log = logging.getLogger(__name__)


# A weight load that fails with these did not reach a serving replica (it is down, restarting or hung), as opposed
# to one that answered and refused the weights (the fleet's GONE_CODE_NAMES).
GONE_CODES = tuple(grpc.StatusCode[name] for name in GONE_CODE_NAMES)


STALL_WARN_S = 30.0
"""No row reported and no step trained for this long: the controller warns (every as long again) until
progress resumes or `stall_timeout_s` fails the run."""


class RunFailed(RuntimeError):
    """The run cannot go on (trainer error, no replica, timeout); the message says which."""


class RunStopped(RunFailed):
    """The run was stopped by a signal after its last complete step (`--resume` continues it)."""


SAMPLES_SUPERSEDED = "samples.superseded.jsonl"


def cut_samples(path: Path, version: int) -> int:
    """samples.jsonl ends at step `version`, as metrics.jsonl does on a resume: the samples logged by later steps
    (lost with the trainer that trained them, logged again when retrained) move to samples.superseded.jsonl beside
    it. Atomic (the file is replaced). Returns how many moved."""
    if not path.exists():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            step = version + 1  # a line cut short by a crash: not kept
        (kept if step <= version else moved).append(line if line.endswith("\n") else line + "\n")
    if not moved:
        return 0
    with open(path.with_name(SAMPLES_SUPERSEDED), "a", encoding="utf-8") as fh:
        fh.writelines(moved)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(moved)


def lost_groups(exc: grpc.aio.AioRpcError, step: StepAssignment) -> set[int] | None:
    """The rows of `step` whose groups the trainer said never arrived (its TrainStep answered FAILED_PRECONDITION
    "groups of rows [r, r#a, ...] did not arrive", fleetrl.trainer.buffer.MissingGroupsError), or None for any other
    failure. A list the trainer cut short ("(+N more)") counts every row of the step as lost."""
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "did not arrive" not in details:
        return None
    match = re.search(r"groups of rows \[([^\]]*)\](\s*\(\+\d+ more\))?", details)
    rows = set(step.row_ids)
    if match is None or match.group(2):
        return rows
    named = {int(item.split("#")[0]) for item in match.group(1).split(",") if item.strip().split("#")[0].isdigit()}
    return (named & rows) or rows


class Orchestrator:
    def __init__(
        self,
        config: ControllerConfig,
        scheduler: RowScheduler,
        members: MemberRegistry,
        *,
        metrics_path: Path,
        trackers: TrackerSet | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`config` gives the run and every timeout (their defaults live in ControllerConfig alone). `clock` runs
        leases, liveness, stall detection and step times: the monotonic clock, which a wall-clock step (NTP, a
        suspended VM, an operator) cannot move; wall time only goes into records (metrics lines, run_end.json)."""
        run = config.run
        self.config = config
        self.run_cfg = run
        self.scheduler = scheduler
        self.members = members
        self.metrics_path = metrics_path
        self.auth_token = config.auth_token
        self.train_step_timeout_s = config.train_step_timeout_s
        self.weight_push_timeout_s = config.weight_push_timeout_s
        self.push_bytes = 0  # bytes of the last version pushed (0: unknown); LoadWeights deadlines grow with them
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.start_timeout_s = config.start_timeout_s
        self.clock = clock
        self.stall_timeout_s = config.stall_timeout_s
        # resume with a trainer without checkpoint: retrain from version 0
        self.restart_weights = config.restart_weights
        self.stop_requested = False  # SIGINT/SIGTERM: stop after the step in flight (request_stop)
        self.last_progress = clock()  # the last row outcome reported or step trained (see check_stalled)
        # The replicas' state machine (fencing, catch-up, push planning): this class carries out its decisions.
        self.fleet = ReplicaFleet(
            members,
            weight_fanout=run.weight_fanout,
            catch_up_backoff_s=config.heartbeat_interval_s,
            forget_after_s=FORGET_AFTER_TIMEOUTS * config.heartbeat_timeout_s,
            configured=[f"inference-{i}" for i in range(len(config.inference_addresses))],
        )
        # The task of the weight load in flight to each replica (a push, or a catch-up of a replica that joined or
        # came back): one at a time per replica.
        self._loading: dict[str, tuple[Member, asyncio.Task[None]]] = {}
        self.wakeup = asyncio.Event()  # set by the servicer when an outcome arrives
        self.lease_signal = LeaseSignal()  # wakes held LeaseRows calls (fleetrl.controller.lease_signal)
        self.finished = False  # this controller's run loop has ended, for whatever reason: no more rows
        self.completed = False  # ... because the run is over (trained, exported): gateways exit 0 (run_finished)
        self.export_path = ""  # where the trainer exported the final model (once finished)
        self.trainer_waits = 0  # checks that found the trainer silent and waited for it (live_trainer_stub)
        every_s = 3 * config.heartbeat_interval_s  # gateways holding rows and silent: warned about (liveness)
        self.silent_holders = SilentLeaseHolders(quiet_s=every_s, every_s=every_s)
        self._stall_warned_at: float | None = None  # when check_stalled last warned (None: progress since)
        self.error = ""
        self.last_metrics: dict[str, float] = {}
        self.step_sums = StepSums()  # every step's learning-curve figures, for counters (ControllerMetrics)
        self.groups_address = ""  # the trainer's rollout-group PULL address, from its Status
        self.evaluation = config.evaluation
        self.eval_timeout_s = config.eval_timeout_s
        self.evaluate_version = -1  # the version an evaluator should evaluate now (-1: none)
        self.evaluated: dict[int, dict[str, float]] = {}
        self.started = False  # set once the trainer and a replica answered and the start version is on the replicas
        self.hold_leases = config.evaluation  # no rollouts until version 0 is evaluated: the start accuracy is exact
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._last_step_end = clock()
        # Where each metrics line goes: metrics.jsonl always, plus the trackers `run.loggers` names.
        self.trackers = trackers or TrackerSet([JsonlTracker(Path(run.log_path), metrics_path)])
        # Groups the gateways rejected since the last step (dynamic filter, too few valid samples) and their
        # samples' rewards: the step's rollout/raw_reward and rollout/filter_ratio count them.
        self._rejected_rewards: list[float] = []
        self._rejected_groups = 0
        self.row_phases = RowPhases()  # accepted rows' gateway phase seconds, until their step's line
        self.row_rewards = RowRewards()  # with a dataset mixture: accepted rows' rewards, for data/<source>/*
        self.told_finished: set[str] = set()  # members a reply has told that the run finished
        self.last_push_fetch_s = self.last_push_swap_s = 0.0
        # Pushes overlapped with training (fleetrl.controller.push_queue): with O >= 1 the next TrainStep does not
        # wait for the last version to reach the replicas. O = 0 stays strictly serial.
        self.overlap = bool(run.overlap_weight_push) and run.max_head_offpolicy_versions >= 1
        self.pushes = PushQueue()
        self._push_task: asyncio.Task[None] | None = None
        self.push_wait_s = 0.0  # seconds the loop waited for pushes since the last step began
        self._ended_pushes: list[tuple[float, float]] = []  # (fetch, swap) of the pushes ended since the last line
        self.engine_stats = EnginePushCounts()  # weight_transport "engine": the trainer's PushEngine replies

    @property
    def pushed_version(self) -> int:
        """The version every replica must serve: the last this process pushed (0: none yet)."""
        return self.fleet.pushed_version

    @pushed_version.setter
    def pushed_version(self, version: int) -> None:
        self.fleet.pushed_version = version

    @property
    def weights_source(self) -> str:
        """Where the replicas fetch the pushed version from (the trainer's weight stream)."""
        return self.fleet.weights_source

    def leasing_open(self) -> bool:
        """Rows may be leased: the run has started (trainer and replica answered; after a resume, the resumed
        version is on every replica), the start evaluation is done, and the run is not over."""
        return self.started and not self.hold_leases and not self.finished and not self.stop_requested

    # --- channels ------------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.auth_token)
        return self._channels[address]

    def trainer_stub(self) -> trainer_pb2_grpc.TrainerStub:
        trainers = self.members.alive("trainer", self.clock())
        if not trainers:
            raise RunFailed("no live trainer registered")
        return trainer_pb2_grpc.TrainerStub(self._channel(trainers[0].address))

    async def live_trainer_stub(self) -> trainer_pb2_grpc.TrainerStub:
        """The trainer's stub once it answers. A trainer that stopped answering Status (a long garbage-collection
        pause, a slow checkpoint write, a busy host) is waited for up to `trainer_patience_s`, with a warning every
        `heartbeat_timeout_s`; the run fails, saying which, when that patience is spent or the trainer is gone
        (nothing has listened at its address for `heartbeat_timeout_s`)."""
        started = self.clock()
        warned: float | None = None
        while not self.members.alive("trainer", self.clock()):
            now = self.clock()
            trainers = [m for m in self.members.members.values() if m.kind == "trainer"]
            if not trainers:
                raise RunFailed("no live trainer registered")
            trainer = trainers[0]
            silent = now - trainer.last_seen
            if trainer.last_error == grpc.StatusCode.UNAVAILABLE.name:
                raise RunFailed(
                    f"the trainer at {trainer.address} is gone: nothing has answered there for {silent:.0f} s "
                    f"(UNAVAILABLE); restart it and the controller with --resume"
                )
            if now - started > self.config.trainer_patience_s:
                raise RunFailed(
                    f"the trainer at {trainer.address} did not answer for {silent:.0f} s (trainer_patience_s "
                    f"{self.config.trainer_patience_s:.0f}; last poll {trainer.last_error or 'unanswered'}): hung"
                )
            if warned is None or now - warned >= self.members.heartbeat_timeout_s:
                warned = now
                log.warning(
                    "the trainer at %s has not answered for %.0f s (%s); waiting up to trainer_patience_s (%.0f s)",
                    trainer.address,
                    silent,
                    trainer.last_error or "no reply",
                    self.config.trainer_patience_s,
                )
            self.trainer_waits += 1
            await asyncio.sleep(min(0.2, self.heartbeat_interval_s))
        return self.trainer_stub()

    liveness_tick: Callable[[], Awaitable[object]] | None = None  # the watchdog's wake-up (None: every_s); tests

    async def _watched(self, call: Awaitable[Any], what: str, kind: str) -> Any:
        """`await call` to the `kind` member, warning every few seconds while it is out and that member has not
        answered Status for 3 poll intervals (fleetrl.controller.liveness)."""
        peers = [m for m in self.members.members.values() if m.kind == kind]
        if not peers:
            return await call
        peer, every_s = peers[0], 3 * self.heartbeat_interval_s
        rule = OverdueCall(what, f"the {kind} at {peer.address}", self.clock(), quiet_s=every_s, every_s=every_s)
        tick = self.liveness_tick or (lambda: asyncio.sleep(every_s))

        def silent() -> float:  # the entry now under its id (a restarted process replaces it)
            return self.clock() - self.members.members.get(peer.member_id, peer).last_seen

        return await watch_call(call, rule, clock=self.clock, silent_s=silent, tick=tick)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # --- membership polling --------------------------------------------------------------------
    async def poll_members(self) -> None:
        """Status-poll trainer and inference members (concurrently: one hung member must not delay the others);
        a reply counts as their heartbeat."""
        members = [m for m in self.members.members.values() if m.kind in ("inference", "trainer")]
        await asyncio.gather(*(self._poll(m) for m in members))

    async def _poll(self, member: Member) -> None:
        try:
            if member.kind == "inference":
                stub = inference_pb2_grpc.InferenceStub(self._channel(member.address))
                token = self.fleet.poll_sent(member)
                status = await stub.Status(inference_pb2.StatusRequest(), timeout=self.heartbeat_interval_s)
                load = self.fleet.status_answered(
                    member,
                    token,
                    int(status.loaded_version),
                    status.relay_address,
                    int(status.relay_version),
                    self.clock(),
                )
                if load is not None:
                    self._start_load(load, self._catch_up(load))
            else:
                stub = trainer_pb2_grpc.TrainerStub(self._channel(member.address))
                status = await stub.Status(trainer_pb2.TrainerStatusRequest(), timeout=self.heartbeat_interval_s)
                self.groups_address = status.groups_address
                self.members.answered_poll(member.member_id, self.clock())
        except grpc.aio.AioRpcError as exc:
            if member.kind == "inference":
                self.fleet.status_missed(member, exc.code().name)
            else:
                self.members.missed_poll(member.member_id, exc.code().name)
                log.debug("%s %s did not answer Status: %s", member.kind, member.member_id, exc.code().name)

    def _start_load(self, load: Load, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` (the load the fleet decided) in the background, one load per replica: one still running for
        the process its member id named before it restarted is cancelled."""
        member = load.member
        previous = self._loading.get(member.member_id)
        if previous is not None and not previous[1].done():
            previous[1].cancel()
        task = asyncio.create_task(work, name=f"{load.kind}-{member.member_id}")
        self._loading[member.member_id] = (member, task)

        def ended(task: asyncio.Task[None]) -> None:  # `work` reports a load that came back; this, any other end
            if task.cancelled():
                self.fleet.load_cancelled(load)
            elif (exc := task.exception()) is not None:
                self.fleet.load_cancelled(load)
                log.error("the %s of replica %s failed", load.kind, member.member_id, exc_info=exc)

        task.add_done_callback(ended)
        return task

    async def _catch_up(self, load: Load) -> None:
        """A fenced replica that answers but serves an older version (it joined the run, restarted, or missed a
        push) is pushed the run's version; it is routable again once loaded."""
        member = load.member
        try:
            reply, src = await self._load_weights(member, load.version, load.plan)
        except grpc.aio.AioRpcError as exc:  # it stays fenced; a later poll tries again (fleet: backing off)
            self.fleet.load_failed(load, exc.code().name, exc.details() or "", self.clock())
            return
        if self.fleet.load_succeeded(load, int(reply.version)):
            log.info("replica %s loaded version %d from %s: back in rotation", member.member_id, reply.version, src)

    async def _cancel_loads(self) -> None:
        tasks = [task for _, task in self._loading.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loading.clear()

    def release_dead_gateways(self) -> None:
        """A gateway that stopped heartbeating is gone: its rows go back to the queue at once."""
        for member in self.members.dead(self.clock()):
            if member.kind == "gateway":
                rows = self.scheduler.release_gateway(member.member_id)
                self.members.remove(member.member_id)
                log.warning("gateway %s missed its heartbeats: requeued rows %s", member.member_id, rows)

    def forget_silent_replicas(self) -> None:
        """Replicas that joined by themselves and never came back are dropped (fleetrl.controller.fleet): no more
        polls or pushes to them; a load still in flight to one is cancelled."""
        for member in self.fleet.forget_silent(self.clock()):
            entry = self._loading.pop(member.member_id, None)
            if entry is not None:
                entry[1].cancel()

    def warn_silent_lease_holders(self) -> None:
        """Warn about gateways that hold leased rows and have stopped heartbeating (fleetrl.controller.liveness)."""
        now = self.clock()
        holders: dict[str, tuple[float, list[int], float]] = {}
        for lease in self.scheduler.leases.values():
            member = self.members.members.get(lease.gateway_id)
            if member is None:
                continue
            _, rows, deadline = holders.setdefault(lease.gateway_id, (now - member.last_seen, [], lease.deadline))
            rows.append(lease.row_id)
            holders[lease.gateway_id] = (now - member.last_seen, rows, min(deadline, lease.deadline))
        for message in self.silent_holders.check(now, holders):
            liveness_log.warning("%s", message)

    async def _poll_forever(self) -> None:
        while not self.finished:
            await self.poll_members()
            self.warn_silent_lease_holders()
            self.release_dead_gateways()
            self.forget_silent_replicas()
            self.scheduler.expire(self.clock())
            self.lease_signal.notify()
            await asyncio.sleep(self.heartbeat_interval_s)

    async def wait_for_members(self) -> None:
        deadline = self.clock() + self.start_timeout_s
        while True:
            await self.poll_members()
            now = self.clock()
            have_trainer = bool(self.members.alive("trainer", now)) and bool(self.groups_address)
            # A replica still serving an older version (fenced) counts: start_version brings it up to date.
            have_replica = bool(self.members.alive("inference", now))
            if have_trainer and have_replica:
                await self.start_version()
                return
            if now > deadline:
                missing = [n for n, ok in (("trainer", have_trainer), ("inference replica", have_replica)) if not ok]
                raise RunFailed(f"no {' and no '.join(missing)} within {self.start_timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def start_version(self) -> None:
        """Start from the trainer's version: after a restart it resumed from its last checkpoint, which the
        scheduler aligns to (`align_to_trainer`); a version past 0 is then published and pushed to every replica,
        since replicas start from the base model."""
        try:
            status = await (await self.live_trainer_stub()).Status(trainer_pb2.TrainerStatusRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise RunFailed(f"trainer did not answer Status: {exc.code().name}: {exc.details()}") from None
        self.check_resume_point(int(status.version))
        try:
            self.scheduler.align_to_trainer(int(status.version))
        except ValueError as exc:
            raise RunFailed(str(exc)) from None
        version = self.scheduler.gate.version
        self.cut_record(version)
        await self.recover_record(version)
        if version == 0:
            return
        try:
            stub = await self.live_trainer_stub()
            reply = await stub.Publish(trainer_pb2.PublishRequest(), timeout=self.weight_push_timeout_s)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            raise RunFailed(f"trainer failed to publish version {version}: {reason}") from None
        await self.push_weights(int(reply.version), reply.weights_address, int(reply.weights_bytes))
        log.info("resumed at version %d: every replica serves it", version)

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        poller = asyncio.create_task(self._poll_forever(), name="member-poller")
        try:
            await self.wait_for_members()
            self.started = True
            self.lease_signal.notify()
            if self.evaluation:
                await self.evaluate(self.scheduler.gate.version, wait=True)
                self.hold_leases = False
                self.lease_signal.notify()
            log.info("run started: version %d, %s", self.scheduler.gate.version, self.scheduler.snapshot())
            while not self.stop_requested:
                if poller.done():
                    poller.result()  # surface a poller crash
                if self.scheduler.journal is not None:
                    self.scheduler.journal.raise_if_failed()  # a lock outlasted stall_timeout_s, maybe in a handler
                self._raise_if_push_failed()
                step = self.scheduler.take_step()
                if step is None:
                    if self.scheduler.finished():
                        break
                    self.wakeup.clear()
                    try:
                        await asyncio.wait_for(self.wakeup.wait(), timeout=0.5)
                    except TimeoutError:
                        self.scheduler.expire(self.clock())
                        self.lease_signal.notify()
                    self.check_stalled()
                    continue
                await self.train_and_publish(step)
            await self.drain_pushes()  # every trained version on the replicas before the end (or the stop)
            if self.stop_requested:
                raise RunStopped(f"stopped by a signal after step {self.scheduler.trained_steps}: --resume continues")
            self.check_trained()
            if self.evaluation:
                await self.evaluate(self.scheduler.gate.version, wait=True)
            await self.finish()
            self.completed = True
        except RunStopped as exc:
            self.error = str(exc)
            log.warning("run %s", self.error)
            raise
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("run failed: %s", self.error)
            raise
        finally:
            self.finished = True
            self.lease_signal.notify()
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            if self._push_task is not None:
                self._push_task.cancel()
                await asyncio.gather(self._push_task, return_exceptions=True)
            await self._cancel_loads()

    def check_stalled(self) -> None:
        """A run where no row is reported and no step trained for `stall_timeout_s` is hung: fail it, saying what
        the pipeline looks like, instead of waiting forever. Before that, from `STALL_WARN_S` of no progress on, warn
        every `STALL_WARN_S` with the same picture (the liveness logger: `fleetrl up` shows it), so a run stuck for
        half an hour (e.g. its only replica fenced) is visible from the first minute."""
        now = self.clock()
        idle = now - self.last_progress
        if idle <= min(STALL_WARN_S, self.stall_timeout_s):
            self._stall_warned_at = None
            return
        picture = self._pipeline_picture(now)
        if idle > self.stall_timeout_s:
            raise RunFailed(
                f"no row reported and no step trained for {idle:.0f} s (stall_timeout_s {self.stall_timeout_s:.0f}): "
                f"{picture}"
            )
        if self._stall_warned_at is None or now - self._stall_warned_at >= STALL_WARN_S:
            self._stall_warned_at = now
            liveness_log.warning(
                "no row reported and no step trained for %.0f s (the run fails at stall_timeout_s %.0f): %s",
                idle,
                self.stall_timeout_s,
                picture,
            )

    def _pipeline_picture(self, now: float) -> str:
        replicas = self.members.alive("inference", now)
        snapshot = self.scheduler.snapshot()
        return (
            f"{len(self.members.routable_replicas(now))} of {len(replicas)} live replicas routable, "
            f"{len(self.members.alive('gateway', now))} live gateways, {snapshot['rows_in_flight']} rows leased, "
            f"{snapshot['rows_queued']} queued, {snapshot['groups_pending']} groups waiting for a step, "
            f"gate {self.scheduler.gate.snapshot()}"
        )

    async def train_and_publish(self, step: StepAssignment) -> None:
        t_start = self.clock()
        wait_time = t_start - self._last_step_end
        push_wait, self.push_wait_s = self.push_wait_s, 0.0  # drains since the last step (evaluations)
        position = json.dumps(
            {"epoch": self.scheduler.cursor.position.epoch, "index": self.scheduler.cursor.position.index}
        )
        request = trainer_pb2.TrainStepRequest(
            step=step.step,
            row_ids=list(step.row_ids),
            data_position=position,
            groups=[trainer_pb2.GroupRef(row_id=r, attempt=a, lease_tag=t) for r, a, t in step.refs],
            superseded=[trainer_pb2.GroupRef(row_id=r, attempt=a) for r, a in self.scheduler.take_superseded()],
        )
        try:
            call = (await self.live_trainer_stub()).TrainStep(request, timeout=self.train_step_timeout_s)
            reply = await self._watched(call, f"TrainStep(step {step.step})", "trainer")
        except grpc.aio.AioRpcError as exc:
            lost = lost_groups(exc, step)
            if lost is None:
                raise RunFailed(f"trainer failed step {step.step}: {exc.code().name}: {exc.details()}") from None
            requeued = self.scheduler.groups_lost(step, lost)
            log.warning(
                "step %d: the groups of rows %s never reached the trainer (%s); those attempts are superseded, rows "
                "%s leased again, and the step is formed again (groups_lost %d)",
                step.step,
                sorted(lost),
                exc.details(),
                requeued,
                self.scheduler.counters.get("groups_lost", 0),
            )
            self.lease_signal.notify()
            return
        t_trained = self.clock()
        self.scheduler.step_trained(step)
        weight_update_time = 0.0
        if reply.published:
            job = PushJob(int(reply.version), reply.weights_address, int(reply.weights_bytes), t_trained)
            if self.overlap:
                self._push_published(job)  # the next TrainStep goes out as soon as its groups are ready
            else:
                weight_update_time = await self.push_weights(job.version, job.source, job.nbytes)
                push_wait += weight_update_time  # the trainer idles for the whole push
                self.scheduler.publish(job.version)
                self.pushes.published(job)
                self.pushes.done(job.version, self.clock())
        elif self.run_cfg.weight_sync_interval == 0:
            # Weights are never pushed: the gate follows the trainer's versions so the run keeps moving.
            self.scheduler.publish(reply.version)
        self.lease_signal.notify()  # the gate may have opened: held LeaseRows calls lease now,
        await self.lease_signal.yield_to_waiters()  # before this step's metrics are written
        t_end = self.clock()
        self._last_step_end = t_end
        self.last_progress = t_end
        fetch = self.last_push_fetch_s if reply.published else 0.0
        swap = self.last_push_swap_s if reply.published else 0.0
        if self.overlap:  # this step's own push is still in flight: the figures of those that ended meanwhile
            ended, self._ended_pushes = self._ended_pushes, []
            fetch, swap = max((f for f, _ in ended), default=0.0), max((s for _, s in ended), default=0.0)
        times = StepTimes(
            wait=wait_time,
            train=t_trained - t_start,
            weight_update=weight_update_time,
            total=t_end - t_start,
            fetch=fetch,
            swap=swap,
            gate_open=t_end - t_trained,
            push_wait=push_wait,
            version_serve=max((s for _, s in self.pushes.take_served()), default=None),
        )
        self.write_metrics(step, reply, times)
        interval = self.run_cfg.evaluation_interval
        if self.evaluation and interval and step.step % interval == 0:
            await self.drain_pushes()  # evaluate the version this step trained, not the one before it
            await self.evaluate(self.scheduler.gate.version, wait=False)

    # --- overlapped pushes (fleetrl.controller.push_queue) -------------------------------------
    def _push_published(self, job: PushJob) -> None:
        start = self.pushes.published(job)
        if start is not None:
            self._start_push(start)
        elif self.pushes.in_flight is not None:
            log.info("version %d waits for the push of version %d", job.version, self.pushes.in_flight.version)

    def _start_push(self, job: PushJob) -> None:
        self._push_task = asyncio.create_task(self._run_push(job), name=f"push-{job.version}")

    async def _run_push(self, job: PushJob) -> None:
        """Push one version beside training; once every replica serves it the gate opens at it, and the version
        that waited meanwhile (if any) goes next."""
        try:
            await self.push_weights(job.version, job.source, job.nbytes)
        except BaseException:
            self.pushes.failed()
            raise
        self._ended_pushes.append((self.last_push_fetch_s, self.last_push_swap_s))
        self.scheduler.publish(job.version)
        self.lease_signal.notify()  # rows may be leased at the new version
        self.wakeup.set()
        following = self.pushes.done(job.version, self.clock())
        if following is not None:
            self._start_push(following)

    def _raise_if_push_failed(self) -> None:
        """Surface a push that failed beside training (RunFailed: every replica refused the weights)."""
        task = self._push_task
        if task is None or not task.done() or task.cancelled():
            return
        error = task.exception()
        if error is not None:
            raise error
        if self._push_task is task:  # ended, and started no next push
            self._push_task = None

    async def drain_pushes(self) -> float:
        """Wait until every published version is on the replicas (the push in flight and the one waiting). The
        seconds waited count as the trainer's wait for pushes (`perf/push_wait_time`)."""
        t0 = self.clock()
        while (task := self._push_task) is not None:
            await task  # raises what the push raised
            if self._push_task is task:
                self._push_task = None
        waited = self.clock() - t0
        self.push_wait_s += waited
        return waited

    async def push_weights(self, version: int, source: str, nbytes: int = 0) -> float:
        """LoadWeights(version) on every live replica (fenced ones too: they may catch up); fence failures. The
        fleet (fleetrl.controller.fleet) plans the push and judges each outcome; this runs the calls.

        With no replica answering (the only one restarting) the run waits: the poller pushes the version to each
        replica that answers again. Only replicas that all answered and refused the weights fail the run."""
        t0 = self.clock()
        slowest = {"fetch": 0.0, "swap": 0.0}  # this push's slowest replica (last_push_* once it ended)
        if nbytes > 0:  # the version's bytes (from the trainer's reply): each load's deadline scales with them
            self.push_bytes = nbytes
        push = self.fleet.start_push(version, source, self.clock())
        # weight_transport "collective": the trainer broadcasts to all of them in one group (fleetrl.weights.collective)
        group_replicas = len(push.loads) if self.run_cfg.weight_transport == "collective" else 0
        # weight_transport "engine": the trainer brings them all to the version through its engine group in one
        # PushEngine call (fleetrl.weights.engine_push); each load below reports its replica's part of the outcome.
        engine_push = None
        if self.run_cfg.weight_transport == "engine" and push.loads:
            engine_push = asyncio.ensure_future(self._push_engine(version, push.loads))

        async def load_one(load: Load) -> None:
            member = load.member
            if engine_push is not None:
                outcome = await asyncio.shield(engine_push)
                if outcome is not None:  # else the call failed: this replica loads over the stream below
                    if member.member_id in outcome.failed or member.member_id not in (
                        *outcome.engine,
                        *outcome.stream,
                    ):
                        reason = outcome.error or "the trainer could not bring it to the version"
                        self.fleet.load_failed(load, "UNAVAILABLE", reason, self.clock(), push)
                        return
                    if self.fleet.load_succeeded(load, version):
                        how = "the engine group" if member.member_id in outcome.engine else "the weight stream"
                        log.info("replica %s loaded version %d through %s", member.member_id, version, how)
                    return
            try:
                reply, src = await self._load_weights(member, version, load.plan, group_replicas)
            except grpc.aio.AioRpcError as exc:
                self.fleet.load_failed(load, exc.code().name, exc.details() or "", self.clock(), push)
                return
            was_fenced = member.fenced
            if not self.fleet.load_succeeded(load, int(reply.version)):
                return  # it restarted during the push: the new process is caught up by the poller
            if was_fenced:
                log.info("replica %s serves version %d again: back in rotation", member.member_id, reply.version)
            slowest["fetch"] = max(slowest["fetch"], reply.transfer_s)
            slowest["swap"] = max(slowest["swap"], reply.pause_s)
            log.info(
                "replica %s loaded version %d from %s (transfer %.3f s, pause %.3f s)",
                member.member_id,
                reply.version,
                src,
                reply.transfer_s,
                reply.pause_s,
            )

        # A replica that stops answering Status during the push (hung, SIGSTOP) is fenced by the poller; its
        # LoadWeights is cancelled then instead of holding the gate for the whole push timeout.
        tasks = {self._start_load(load, load_one(load)): load for load in push.loads}
        pending, abandoned = set(tasks), []
        while pending:
            _, pending = await asyncio.wait(pending, timeout=self.heartbeat_interval_s)
            for task in [t for t in pending if self.fleet.unresponsive(tasks[t])]:
                self.fleet.push_abandoned(tasks[task])
                task.cancel()
                pending.discard(task)
                abandoned.append(task)
        await asyncio.gather(*abandoned, return_exceptions=True)
        if engine_push is not None:
            await engine_push  # returns (None on failure) once the trainer answered or its deadline passed
        for task in tasks:
            if not task.cancelled():
                task.result()  # surface a bug in load_one()
        failure = self.fleet.finish_push(push, self.clock())
        if failure is not None:
            raise RunFailed(failure)
        self.last_push_fetch_s, self.last_push_swap_s = slowest["fetch"], slowest["swap"]
        return self.clock() - t0

    async def _push_engine(self, version: int, loads: list[Load]) -> trainer_pb2.PushEngineResponse | None:
        """PushEngine(version) to the trainer for the replicas of `loads` (weight_transport "engine"); None when the
        call failed (each replica then loads over the weight stream, one logged line): the engine path never
        fails a push that the stream can carry."""
        request = trainer_pb2.PushEngineRequest(
            version=version,
            replicas=[trainer_pb2.EngineReplica(name=ld.member.member_id, address=ld.member.address) for ld in loads],
        )
        deadline_s = push_deadline_s(self.weight_push_timeout_s, self.push_bytes) + 5
        try:
            reply = await self.trainer_stub().PushEngine(request, timeout=deadline_s)
        except (grpc.aio.AioRpcError, RunFailed) as exc:
            self.engine_stats.call_failed(version)
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("PushEngine(%d) failed (%s): the replicas load it over the weight stream", version, why)
            return None
        self.engine_stats.pushed(reply)
        return reply

    async def _load_weights(
        self, member: Member, version: int, plan: PushSource, group_replicas: int = 0
    ) -> tuple[Any, str]:
        """LoadWeights(version) from `plan`'s source; a relayed load from a peer that the replica answered with a
        failure (its upstream died, stalled or does not hold the version) is tried once more from the trainer
        directly, so a failure in a chain never wedges a push. `group_replicas` > 0: a collective push to that many
        replicas (a replica that cannot join falls back to the stream itself; catch-ups stay on the stream).
        Returns the reply and the source it loaded from; raises the last AioRpcError."""
        stub = inference_pb2_grpc.InferenceStub(self._channel(member.address))

        async def load(source: str) -> Any:
            request = inference_pb2.LoadWeightsRequest(
                version=version, source=source, timeout_s=self.weight_push_timeout_s, relay=plan.relay
            )
            if group_replicas > 0 and not plan.relay:
                request.transport, request.group_replicas = "collective", group_replicas
            deadline_s = push_deadline_s(self.weight_push_timeout_s, self.push_bytes)  # the floor + the bytes
            return await stub.LoadWeights(request, timeout=deadline_s + 5)

        source = plan.source
        try:
            reply = await load(source)
        except grpc.aio.AioRpcError as exc:
            trainer = self.weights_source
            if exc.code() in GONE_CODES or not trainer or not plan.from_peer(trainer):
                raise
            log.warning(
                "replica %s could not load version %d relayed from %s (%s: %s): loading it from the trainer",
                member.member_id,
                version,
                source,
                exc.code().name,
                exc.details(),
            )
            source = trainer
            reply = await load(source)
        return reply, source

    def request_stop(self) -> None:
        """Stop after the step in flight (SIGINT/SIGTERM): its metrics line is written and the trainer, stopped
        after the controller, checkpoints it, so `--resume` loses nothing."""
        self.stop_requested = True
        self.wakeup.set()
        self.lease_signal.notify()

    def check_trained(self) -> None:
        """A run that updated the weights in no step fails, saying why, instead of having the trainer export the
        base model as the run's final model (fleetrl.controller.run_outcome)."""
        steps = self.scheduler.trained_steps
        message = untrained_run_message(
            steps_trained=steps,
            steps_empty=steps_without_update(self.metrics_path, steps),
            counters=self.scheduler.counters,
            max_seq_len=resolve_max_seq_len(self.run_cfg),
        )
        if message is not None:
            raise RunFailed(f"{message}; nothing exported")

    def check_resume_point(self, trainer_version: int) -> None:
        """A resumed journal with trained steps and a trainer back at version 0 (it had no checkpoint) would train
        those steps again from the base model: only when asked (`restart_weights`)."""
        trained = self.scheduler.trained_steps
        if not self.scheduler.resumed or trainer_version > 0 or trained == 0 or self.restart_weights:
            return
        raise RunFailed(
            f"--resume: the trainer has no checkpoint to resume from (it starts at version 0) but the journal has "
            f"{trained} trained steps, which would be trained again from the base model. Pass --restart-weights to "
            "do that, or start the run over with --overwrite. A checkpoint is saved every dcp_save_interval steps and "
            "when the run is stopped (Ctrl-C, SIGTERM); a killed trainer saves none."
        )

    def cut_record(self, version: int) -> None:
        """metrics.jsonl ends at the version the run starts from: lines of steps after it (lost with the trainer
        that trained them, trained again now) move to metrics.superseded.jsonl, so the record keeps one line per
        step. A fresh run (no journal) moves an earlier run's lines aside."""
        resumed = self.scheduler.resumed
        if resumed and (torn := cut_torn_tail(self.metrics_path)) is not None:  # a crash or a full disk mid-line
            log.warning(
                "%s ended in a line cut short (%r): removed; its step's line is written again from the trainer's "
                "record of it",
                self.metrics_path.name,
                torn[:80],
            )
        moved = cut_to_version(self.metrics_path, version if resumed else -1)
        if moved:
            log.info("metrics.jsonl cut back to version %d: %d lines moved to %s", version, moved, SUPERSEDED)
        samples = Path(self.run_cfg.log_path) / SAMPLES_FILE  # the logged samples of those steps go the same way
        if moved := cut_samples(samples, version if resumed else -1):
            log.info(
                "%s cut back to version %d: %d samples moved to %s", samples.name, version, moved, SAMPLES_SUPERSEDED
            )
        if resumed and self.metrics_path.exists():
            # Evaluations of versions up to the resumed one stand: they are not run (and written) again.
            for line in one_per_step(read_lines(self.metrics_path))[1]:
                metrics = {k.removeprefix("eval/"): v for k, v in line.items() if k.startswith("eval/")}
                self.evaluated[int(line["step"])] = metrics

    async def recover_record(self, version: int) -> list[int]:
        """Write the metrics line and the samples of each recent step up to `version` that the record lacks (the
        controller was killed before it heard back about the step, or before it wrote the step's line), from the
        trainer's result of the step: a TrainStep for a step already trained answers with it again
        (fleetrl.controller.step_recovery). The files say what is missing, so a controller killed again halfway
        through writes only the rest. Returns the steps it wrote something for."""
        line_steps: set[int] = set()
        if self.metrics_path.exists():
            line_steps = {int(line.get("step", 0)) for line in one_per_step(read_lines(self.metrics_path))[0]}
        sample_steps = steps_in_samples(Path(self.run_cfg.log_path) / SAMPLES_FILE)
        written = []
        for step in steps_to_recover(version, line_steps, sample_steps, self.run_cfg.log_samples_interval):
            try:
                stub = await self.live_trainer_stub()
                request = trainer_pb2.TrainStepRequest(step=step)
                reply = await stub.TrainStep(request, timeout=self.train_step_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("step %d lacks its record and the trainer did not give it: %s", step, exc.details())
                continue
            if not reply.metrics:
                log.warning(
                    "step %d has no line in %s and the trainer kept no record of it (it resumed from a checkpoint "
                    "written before it kept step records): that line stays missing",
                    step,
                    self.metrics_path.name,
                )
                continue
            if step not in line_steps:
                done_frac = done_fraction(
                    step, self.scheduler.max_steps, self.scheduler.cursor.total_rows, self.scheduler.groups_per_step
                )
                line = recovered_line(
                    dict(reply.metrics),
                    step=step,
                    version=int(reply.version),
                    time=time.time(),
                    done_frac=done_frac,
                    counters=self.scheduler.counters,
                )
                self._append_metrics(line)
            if step not in sample_steps and reply.samples:
                self.trackers.log_samples(step, self._sample_rows(step, reply))
            written.append(step)
            log.warning(
                "step %d was trained but its record was lost with the controller that ran it: its %s written again "
                "from the trainer's result of it",
                step,
                "line and samples" if reply.samples and step not in sample_steps else "line",
            )
        return written

    async def finish(self) -> None:
        position = json.dumps(
            {"epoch": self.scheduler.cursor.position.epoch, "index": self.scheduler.cursor.position.index}
        )
        try:
            reply = await (await self.live_trainer_stub()).Finish(
                trainer_pb2.FinishRequest(data_position=position), timeout=self.train_step_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise RunFailed(f"trainer failed to finish: {exc.code().name}: {exc.details()}") from None
        self.export_path = reply.export_path
        log.info("run finished at version %d; final model exported to %s", reply.version, reply.export_path)
        if slow := self.scheduler.counters.get("rows_failed_stale", 0):
            log.warning(
                "%d rows were dropped as too slow (stale on every attempt: slow, not wrong; rows_failed_stale)", slow
            )

    # --- evaluation ----------------------------------------------------------------------------
    async def evaluate(self, version: int, wait: bool) -> None:
        """Ask the evaluator gateway to evaluate the live `version`; at start and end, wait for its report."""
        if version in self.evaluated:
            return
        self.evaluate_version = version
        if not wait:
            return
        deadline = self.clock() + self.eval_timeout_s
        while version not in self.evaluated:
            if self.clock() > deadline:
                log.warning(
                    "no evaluation of version %d within %.0f s; going on without it", version, self.eval_timeout_s
                )
                self.evaluate_version = -1
                return
            self.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), timeout=0.5)

    def record_eval(self, version: int, metrics: dict[str, float]) -> None:
        """A gateway's evaluation of `version`: one metrics line. A repeat (a gateway sends a report again when
        its reply was lost) changes nothing."""
        if version in self.evaluated:
            log.info("evaluation of version %d reported again: already recorded, ignored", version)
            return
        self.evaluated[version] = dict(metrics)
        if self.evaluate_version == version:
            self.evaluate_version = -1
        line = {"step": version, "version": version, "time": time.time()}
        line.update({f"eval/{k}": float(v) for k, v in metrics.items()})
        self._append_metrics(line)
        log.info("evaluation of version %d: %s", version, metrics)
        self.wakeup.set()

    def rows_reported(self, count: int, now: float) -> None:
        """Gateways reported `count` row outcomes at `now`: progress for the stall check (`check_stalled`) when
        any, and the loop wakes up to look for a complete step."""
        if count:
            self.last_progress = now
        self.wakeup.set()
        self.lease_signal.notify()  # a failed row goes back to the queue

    @property
    def stopped(self) -> bool:
        """This controller ended without finishing the run (a signal, a failure): a reply says `run_stopped`, not
        `run_finished`, and a gateway waits for a resumed controller instead of exiting 0."""
        return self.finished and not self.completed

    def end_record(self) -> dict[str, Any]:
        """How this controller's run ended, for `<log_path>/run_end.json` (read by `fleetrl status` once the
        controller is gone): finished, stopped (a signal) or failed, at which step and version, why, the final
        evaluation and where the final model is."""
        version = self.scheduler.gate.version
        outcome = "finished" if self.completed else "stopped" if self.stop_requested else "failed"
        return {
            "outcome": outcome,
            "error": self.error,
            "trained_steps": self.scheduler.trained_steps,
            "version": version,
            "final_model": self.export_path or None,
            "final_eval": self.evaluated.get(version),
            # Rows the run dropped: too slow (stale on every attempt: slow, not wrong) or failing every attempt.
            "rows_dropped_slow": int(self.scheduler.counters.get("rows_failed_stale", 0)),
            "rows_dropped_failing": int(self.scheduler.counters.get("rows_failed", 0)),
            "time": time.time(),
        }

    def told_if_finished(self, member_id: str) -> None:
        """A reply to `member_id` is about to say whether the run ended (finished or stopped): remember those told
        it has."""
        if self.finished:
            self.told_finished.add(member_id)

    async def wait_gateways_told(self, timeout_s: float) -> None:
        """Until every live gateway has been told the run finished (so none is left retrying a controller that
        is gone), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = {m.member_id for m in self.members.alive("gateway", self.clock())}
            if live <= self.told_finished:
                return
            await asyncio.sleep(0.02)

    def record_row_phases(self, row_id: int, phase_s: dict[str, float]) -> None:
        """An accepted row's gateway phase seconds: their means over a step's rows go in its line."""
        self.row_phases.record(row_id, phase_s)

    def record_row_rewards(self, row_id: int, rewards: list[float]) -> None:
        """An accepted row's rewards: with a dataset mixture its source's mean reward goes in its step's line."""
        if isinstance(self.scheduler.cursor, MixtureCursor):
            self.row_rewards.record(row_id, rewards)

    def record_rejected(self, rewards: list[float]) -> None:
        """A gateway rejected a group (its samples' rewards): counted in the next step's filter metrics."""
        self._rejected_groups += 1
        self._rejected_rewards.extend(float(r) for r in rewards)

    def _append_metrics(self, line: dict[str, Any]) -> None:
        self.trackers.log_metrics(int(line["step"]), line)

    def close_trackers(self, failed: bool) -> None:
        failures = {name: n for name, n in self.trackers.failures.items() if n}
        if failures:
            log.warning("tracker failures during the run (metrics.jsonl has every step): %s", failures)
        self.trackers.close(failed=failed)

    # --- metrics -------------------------------------------------------------------------------
    @staticmethod
    def _sample_rows(step: int, reply: Any) -> list[dict[str, Any]]:
        """The logged samples of a TrainStep reply, as samples.jsonl rows (with their token ids when the trainer
        sent them: log_samples_token_ids)."""
        rows = []
        for s in reply.samples:
            ids = len(s.prompt_token_ids) + len(s.completion_token_ids) > 0
            sample = LoggedSample(
                step,
                s.row_id,
                s.prompt,
                s.completion,
                s.reward,
                s.version_offset,
                s.finish_reason,
                prompt_token_ids=list(s.prompt_token_ids) if ids else None,
                completion_token_ids=list(s.completion_token_ids) if ids else None,
            )
            rows.append(sample.as_row())
        return rows

    def write_metrics(self, step: StepAssignment, reply: Any, times: StepTimes) -> None:
        line = step_line(
            dict(reply.metrics),
            step=step.step,
            version=int(reply.version),
            time=time.time(),
            admitted_offsets=step.version_offsets,
            rejected_rewards=self._rejected_rewards,
            rejected_groups=self._rejected_groups,
            done_frac=done_fraction(
                step.step, self.scheduler.max_steps, self.scheduler.cursor.total_rows, self.scheduler.groups_per_step
            ),
            times=times,
            counters=self.scheduler.counters,
            tracker_failures=self.trackers.total_failures,
            row_phases=self.row_phases.take_step(step.row_ids),
        )
        line["async/versions_superseded"] = self.pushes.superseded
        if self.run_cfg.weight_transport == "engine":  # the engine group's builds, fallbacks, the last version's way
            line.update(self.engine_stats.figures())
        cursor = self.scheduler.cursor
        if isinstance(cursor, MixtureCursor):  # per source: rows drawn, groups and mean reward in this step
            line.update(cursor.figures())
            line.update(self.row_rewards.take_step(step.row_ids, cursor.source_of))
        self._rejected_rewards, self._rejected_groups = [], 0
        self.last_metrics = {k: float(v) for k, v in line.items() if isinstance(v, int | float)}
        self.step_sums.add(line)
        self._append_metrics(line)
        if reply.samples:
            self.trackers.log_samples(step.step, self._sample_rows(step.step, reply))
        log.info(
            "step %d version %d reward %.3f offset_max %d wait %.2fs train %.2fs",
            step.step,
            reply.version,
            line.get(mn.RAW_REWARD, float("nan")),
            line.get("async/version_offset_max", -1),
            times.wait,
            times.train,
        )
