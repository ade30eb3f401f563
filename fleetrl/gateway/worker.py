"""The rollout gateway (`Gateway`): lease rows, run G rollouts per row under bounded concurrency, send accepted groups
to the trainer over ZeroMQ, report every row's outcome to the controller.

Failures: a rollout returning None drops that sample; recoverable errors (timeouts, no replica, a gRPC code in
fleetrl.gateway.sampler.RETRYABLE_CODES) are retried with backoff; other exceptions drop the sample, with the traceback
logged once per error type; the circuit breaker stops the gateway when half of the last 100 rollouts (in start
order, at least 20) failed (exit code 3; fleetrl.gateway.circuit_breaker). While no replica is routable (the only
one restarting) Generate calls wait for one (the sampler, up to `replica_wait_s`) and the replica list is refreshed
even with every row slot busy; a rollout that still finds none is an outage, not the rollout function's failure: the
breaker does not count it, and a row that lost samples to it is reported FAILED (leased again later) rather than
rejected. A rollout past `rollout_timeout_s` is cancelled, dropped and counted, not retried; one Generate call has
its own `generate_timeout_s` (retried on another replica). A rollout returning an unknown type stops the gateway
(exit code 4, the type named: fleetrl.rollout.RolloutReturnTypeError). A group with fewer than `min_group_size`
valid samples has its missing members run again, up to `max_incomplete_group_retries` times, before it is rejected.
Every row outcome and evaluation is reported at least once: a report the controller did not answer (a transient
gRPC error) is sent again until it answers or `controller_lost_s` passes (the controller takes a repeat as late).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import traceback
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import grpc

from fleetrl.exit_codes import EXIT_CIRCUIT_OPEN, EXIT_CONTROLLER_LOST, EXIT_USER_CODE
from fleetrl.gateway.assembly import assemble_group
from fleetrl.gateway.circuit_breaker import CircuitBreaker, CircuitOpenError
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.dynamic_filter import DynamicFilter
from fleetrl.gateway.judge import attach_judge, follow_judges, load_judge_tokenizer
from fleetrl.gateway.sampler import RETRYABLE_CODES, NoReplicaError, Sampler
from fleetrl.gateway.sampling_seed import RolloutKey, rollout_seed_scope
from fleetrl.group_stream import GroupSender, GroupStreamError
from fleetrl.rollout import (
    DATASET_CONTEXT_ARGS,
    EvaluationShape,
    RolloutFnFactory,
    RolloutReturnTypeError,
    RolloutSetup,
    declared_context_args,
    evaluation_call_shape,
    is_group_rollout,
    make_evaluation_rollout_fn,
    rollout_result_samples,
)
from fleetrl.rpc import open_channel
from fleetrl.seq_len import resolve_max_seq_len
from fleetrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


def latency_quantiles(values: Sequence[float], quantiles: Sequence[float]) -> list[float]:
    """The `quantiles` (0..1) of `values` (nearest rank; NaN when there are none)."""
    ordered = sorted(values)
    if not ordered:
        return [float("nan")] * len(quantiles)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in quantiles]


CONTROLLER_GONE_CODES = (*RETRYABLE_CODES, grpc.StatusCode.CANCELLED)
"""A controller call that failed with one of these is made again (until `controller_lost_s`): the transient codes,
and CANCELLED, which a call in flight (a held LeaseRows) gets when the controller's server stops under it."""


class ControllerLost(RuntimeError):
    """The controller did not answer for longer than `controller_lost_s`."""


class Gateway:
    """One rollout gateway: `await Gateway(config, factory, tokenizer, ...).run()` until the run is finished; its
    exit code (0, EXIT_CIRCUIT_OPEN, EXIT_USER_CODE) or an exception. `counters` and `breaker` are read by /metrics.

    `controller` (the controller's gRPC stub, or anything with its methods) and `sampler` (a `SamplerLike`) are
    taken from outside when given; otherwise `run()` opens a channel to the controller and
    `prepare_rollouts()` builds a `Sampler` over the run's replicas."""

    def __init__(
        self,
        config: GatewayConfig,
        rollout_factory: RolloutFnFactory,
        tokenizer: Any = None,
        dynamic_filter: DynamicFilter | None = None,
        evaluation_fn: Any = None,
        vocab_size: int | None = None,
        *,
        controller: Any = None,
        sampler: Any = None,
    ) -> None:
        self.config = config
        self.stub: Any = controller
        self.sampler: Any = sampler
        self.setup: RolloutSetup | None = None
        self.rollout_fn: Any = None
        self.judge_sampler: Any = None
        self.run_cfg = config.run
        self.gateway_id = config.gateway_id or f"gateway-{socket.gethostname()}-{os.getpid()}"
        self.rollout_factory = rollout_factory
        self.tokenizer = tokenizer
        self.dynamic_filter = dynamic_filter
        self.evaluation_fn = evaluation_fn
        self.vocab_size = vocab_size  # the model's embedding rows: a sample with a token id >= it is dropped
        self.eval_rows: list[dict[str, Any]] = []
        self._eval_started: set[int] = set()
        self.breaker = CircuitBreaker(
            window=config.breaker_window,
            min_attempts=config.breaker_min_attempts,
            max_failure_rate=config.breaker_max_failure_rate,
        )
        self.counters: Counter[str] = Counter()
        self._seen_errors: set[str] = set()
        self._sender: GroupSender | None = None
        self._send_lock = asyncio.Lock()
        limit = self.run_cfg.max_concurrency or self.config.rows_in_flight * self.run_cfg.completions_per_prompt
        self._slots = asyncio.Semaphore(limit)
        self._last_contact = time.monotonic()
        self.heartbeat_interval_s = 2.0
        self.report_retry_s = 0.2  # the first pause before a report the controller did not answer is sent again
        self._joined = False  # a controller has answered ("started" is logged then)
        self._waiting_for_resume = False  # the controller said run_stopped: wait for a resumed one (_stopped)
        self.row_seconds_sum = 0.0  # lease -> outcome reported, summed over rows (latency = sum / rows_done)
        self.row_latencies_s: deque[float] = deque(maxlen=100_000)
        self._group_fn = False  # the rollout function is a group rollout (fleetrl.rollout.group_rollout)
        self._context_args: tuple[str, ...] = ()  # the context keyword arguments it declares
        self._num_rows: int | None = None  # dataset rows: row id -> (epoch, cursor_index)
        self._evaluation_shape: EvaluationShape = "setup_rows"  # how evaluation_fn is called (_prepare_evaluation)
        self._evaluation_rollout_fn: Any = None
        self.controller_address = config.controller_address  # or, once run() read it, the ready file's

    # --- controller calls ----------------------------------------------------------------------
    async def _call(self, method: Any, request: Any) -> Any:
        try:
            reply = await method(request, timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            gone = exc.code() in CONTROLLER_GONE_CODES
            if gone and time.monotonic() - self._last_contact < self.config.controller_lost_s:
                return None
            if gone:
                raise ControllerLost(
                    f"controller {self.controller_address} unreachable for {self.config.controller_lost_s:.0f} s"
                ) from None
            raise
        self._last_contact = time.monotonic()
        if not self._joined:  # logged once a controller answered (operators and tests read it as "joined")
            self._joined = True
            log.info("gateway %s started (controller %s)", self.gateway_id, self.controller_address)
        return reply

    async def _newest_version(self) -> int | None:
        """The newest version this run has trained (a replica can serve none newer), asked of the controller; None
        when it does not answer (the sampler then judges by the version its last lease reply gave)."""
        try:
            status = await self._call(self.stub.GetStatus, controller_pb2.GetStatusRequest())
        except grpc.aio.AioRpcError as exc:
            log.warning("GetStatus (the run's newest version) failed: %s", exc.code().name)
            return None
        return None if status is None else max(status.version, status.trained_steps)

    async def _deliver(self, method: Any, request: Any, what: str) -> Any:
        """A report (`ReportRows`, `ReportEval`) delivered at least once: a transient failure (RETRYABLE_CODES) is
        retried with backoff until the controller answers or has been unreachable for `controller_lost_s`
        (ControllerLost). A report the controller already applied (only its reply was lost) changes nothing the
        second time: it names the row's attempt, and the controller takes a report for an attempt no longer
        leased as late."""
        pause = self.report_retry_s
        while True:
            reply = await self._call(method, request)
            if reply is not None:
                return reply
            self.counters["reports_retried"] += 1
            log.warning("%s: the controller did not answer; sending it again in %.1f s", what, pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 5.0)

    # --- the loop ------------------------------------------------------------------------------
    async def prepare_rollouts(self) -> RolloutSetup:
        """The rollouts' wiring, which `run()` does before it leases (and a test that drives `process_row` or
        `evaluate` itself): the sampler (the one given, else a `Sampler` over the run's replicas), the
        `RolloutSetup`, the judge pool (`[up] judge_model`; before the factory runs, which may keep
        `setup.judge_sampler`), and the rollout function from the factory."""
        if self.sampler is None:
            self.sampler = Sampler(
                self.tokenizer,
                auth_token=self.config.auth_token,
                request_timeout_s=self.config.generate_timeout_s,
                replica_wait_s=self.config.replica_wait_s,
                default_kwargs=self.run_cfg.sample_kwargs,
                vocab_size=self.vocab_size,
                version_probe=self._newest_version,
            )
        setup = RolloutSetup.for_run(self.run_cfg, self.tokenizer, self.sampler)
        judge_tokenizer = await asyncio.to_thread(load_judge_tokenizer, self.config, self.tokenizer)
        self.judge_sampler = attach_judge(setup, self.config, judge_tokenizer)  # on its /metrics
        self.rollout_fn = self.rollout_factory(setup)
        self.setup = setup
        self._set_context_args()
        if self.evaluation_fn is not None:
            self._prepare_evaluation()
        return setup

    async def run(self) -> int:
        if self.config.controller_ready_file:  # started beside the controller: its address once it serves
            from fleetrl.ready_file import wait_ready_file

            info = await asyncio.to_thread(
                wait_ready_file, self.config.controller_ready_file, self.config.controller_ready_timeout_s
            )
            self.controller_address = str(info["address"])
            self._last_contact = time.monotonic()
        if self.stub is None:
            channel = open_channel(self.controller_address, self.config.auth_token)
            self.stub = controller_pb2_grpc.ControllerStub(channel)
        setup = await self.prepare_rollouts()
        judge_sampler = self.judge_sampler
        follower = None  # compose's scaled judge service: the replicas its name resolves to, looked up again
        if judge_sampler is not None and self.config.judge_resolve_s is not None:
            follow = follow_judges(judge_sampler, self.config.judge, self.config.judge_resolve_s)
            follower = asyncio.create_task(follow, name="judge-lookup")
        tasks: set[asyncio.Task[None]] = set()
        try:
            registered = await self._register()
            if registered is None:
                log.info(
                    "gateway %s: no answer from the controller at %s yet; it joins once one answers",
                    self.gateway_id,
                    self.controller_address,
                )
            if registered is not None and registered.run_finished:  # started after the run ended (the reply told us)
                return self._finished(tasks)
            if registered is not None:
                self._stopped(registered, tasks)
            while True:
                _reap(tasks)
                heartbeat = await self._heartbeat_if_due()
                if heartbeat is not None:
                    if heartbeat.run_finished:  # the controller counts this reply as telling us, as a lease reply
                        return self._finished(tasks)
                    if self._stopped(heartbeat, tasks):
                        continue
                    self._maybe_evaluate(heartbeat.evaluate_version, tasks)
                want = max(self.config.rows_in_flight - len(tasks), 0)
                reply = None
                # max_rows 0: only the routable replicas. A busy gateway refreshes them every heartbeat too, so calls
                # in flight to a replica the controller fenced (hung, stopped) move to another one.
                lease_s = 0.0
                if want > 0 or self.sampler.wants_replicas or heartbeat is not None:
                    # Held by the controller until rows are leasable (up to lease_wait_s), unless the replica list
                    # is wanted now. lease_s is the call's time, a hold included: the rows' wait for the gate.
                    wait_s = 0.0 if self.sampler.wants_replicas else self.config.lease_wait_s
                    request = controller_pb2.LeaseRowsRequest(
                        gateway_id=self.gateway_id,
                        max_rows=want,
                        wait_s=wait_s,
                        max_leased=self.config.rows_in_flight,  # a held call leases what is free when it wakes
                    )
                    t_lease = time.monotonic()
                    reply = await self._call(self.stub.LeaseRows, request)
                    lease_s = time.monotonic() - t_lease
                if reply is not None and self._stopped(reply, tasks):
                    await asyncio.sleep(_idle_pause(reply))
                    continue
                if reply is not None:
                    self.sampler.set_replicas([r.address for r in reply.replicas])
                    if isinstance(self.sampler, Sampler):  # replies naming a newer version are checked against it
                        self.sampler.set_version(reply.version)
                    self._maybe_evaluate(reply.evaluate_version, tasks)
                    if reply.groups_address and (self._sender is None or self._sender.address != reply.groups_address):
                        self._sender = GroupSender(
                            reply.groups_address,
                            auth_token=self.config.auth_token,
                            send_timeout_s=self.config.send_timeout_s,
                        )
                    for leased in reply.rows:
                        tasks.add(asyncio.create_task(self.process_row(leased, lease_s), name=f"row-{leased.row_id}"))
                    if reply.run_finished:
                        return self._finished(tasks)
                # Rows came: fill the rest of the capacity at once (a held call that woke when the gate opened leased
                # what the gateway could take then). After a held call with none the controller says retry_after_s
                # 0: ask again at once (it holds the next call).
                pause = 0.0 if reply is not None and reply.rows else _idle_pause(reply)
                if tasks:
                    await asyncio.wait(tasks, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
                elif pause > 0:
                    await asyncio.sleep(pause)
        except CircuitOpenError as exc:
            log.error("gateway %s stopped: %s", self.gateway_id, exc)
            return EXIT_CIRCUIT_OPEN
        except ControllerLost as exc:
            what = "stopped the run and none resumed it" if self._waiting_for_resume else "is gone"
            log.error("gateway %s stopped: %s (the controller %s)", self.gateway_id, exc, what)
            return EXIT_CONTROLLER_LOST
        except RolloutReturnTypeError as exc:
            log.error("gateway %s stopped: %s", self.gateway_id, exc)
            return EXIT_USER_CODE
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if setup.sessions is not None:  # the agent session server, if a rollout opened a session
                await setup.sessions.close()
            await self.sampler.close()
            if follower is not None:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
            if judge_sampler is not None:
                await judge_sampler.close()
            if self._sender is not None:
                self._sender.close()
            await channel.close()

    def _stopped(self, reply: Any, tasks: set[asyncio.Task[None]]) -> bool:
        """Whether `reply` says the controller stops without finishing the run (a signal, a failure). Then the
        rows in flight are dropped (a resumed controller leases them again from its journal) and the gateway waits,
        up to `controller_lost_s` after that reply, for a controller that answers without saying so (ControllerLost
        then), instead of exiting 0 as for a finished run."""
        if not reply.run_stopped:
            if self._waiting_for_resume:
                log.info("gateway %s: a controller answers and the run goes on", self.gateway_id)
                self._waiting_for_resume = False
            return False
        if not self._waiting_for_resume:
            self._waiting_for_resume = True
            _reap(tasks)
            for task in tasks:
                task.cancel()
            self._eval_started.clear()  # a resumed controller asks again for what was not evaluated
            log.warning(
                "gateway %s: the controller stopped the run without finishing it (signal or failure); dropped %d rows "
                "in flight, waiting up to %.0f s (controller_lost_s) for a resumed controller",
                self.gateway_id,
                len(tasks),
                self.config.controller_lost_s,
            )
        return True

    def _finished(self, tasks: set[asyncio.Task[None]]) -> int:
        """A reply (lease or heartbeat) said the run finished: exit 0 now. Nothing a task still running could
        produce would be used, and the controller may already be gone (it counts that reply as having told this
        gateway), so no other call is made."""
        _reap(tasks)
        if tasks:
            log.warning("run finished: cancelling %d tasks still in flight", len(tasks))
        log.info(
            "run finished; gateway %s exits (%s, row latency p50=%.2f ms p99=%.2f ms)",
            self.gateway_id,
            dict(self.counters),
            *(1000 * q for q in latency_quantiles(self.row_latencies_s, (0.5, 0.99))),
        )
        return 0

    async def _register(self) -> Any:
        """Register with the controller; its reply (None when the call was not answered), which says whether the
        run already ended (the controller counts it as having told this gateway, as a heartbeat reply)."""
        reply = await self._call(
            self.stub.Register,
            controller_pb2.RegisterRequest(kind=controller_pb2.GATEWAY, member_id=self.gateway_id),
        )
        if reply is not None:
            self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        return reply

    async def _heartbeat_if_due(self) -> Any:
        """Busy gateways do not lease; the heartbeat keeps the controller from taking their rows back."""
        if time.monotonic() - self._last_contact < self.heartbeat_interval_s:
            return None
        reply = await self._call(self.stub.Heartbeat, controller_pb2.HeartbeatRequest(member_id=self.gateway_id))
        if reply is not None and not reply.known:
            await self._register()
        return reply

    # --- evaluation ----------------------------------------------------------------------------
    def _maybe_evaluate(self, version: int, tasks: set[asyncio.Task[None]]) -> None:
        if self.evaluation_fn is None or version < 0 or version in self._eval_started:
            return
        self._eval_started.add(version)
        tasks.add(asyncio.create_task(self.evaluate(version), name=f"eval-{version}"))

    def _prepare_evaluation(self) -> None:
        """How the evaluation hook is called (`evaluation_call_shape`): the current cookbook's `(step, rollout_fn)`
        gets the version and the rollout function with `evaluation=True`; fleetrl's `(setup, rows)` gets the
        held-out rows of run.eval_dataset, loaded here."""
        self._evaluation_shape = evaluation_call_shape(self.evaluation_fn)
        if self._evaluation_shape == "step_rollout_fn":
            self._evaluation_rollout_fn = make_evaluation_rollout_fn(self.rollout_fn)
            return
        if not self.run_cfg.eval_dataset:
            raise ValueError("--evaluation needs run.eval_dataset (a JSONL of held-out rows)")
        from fleetrl.controller.dataset import load_rows

        self.eval_rows = load_rows(self.run_cfg.eval_dataset)

    def _evaluation_call(self, version: int) -> Any:
        if self._evaluation_shape == "step_rollout_fn":
            return self.evaluation_fn(version, self._evaluation_rollout_fn)
        return self.evaluation_fn(self.setup, list(self.eval_rows))

    async def evaluate(self, version: int) -> None:
        """Run the evaluation hook against the live replicas (the version is the step: optimizer batches done);
        report eval/* metrics (a hook returning None reports none of its own)."""
        started = time.monotonic()
        try:
            metrics = await asyncio.wait_for(self._evaluation_call(version), timeout=self.config.eval_timeout_s)
            metrics = {str(k): float(v) for k, v in dict(metrics or {}).items()}
        except TimeoutError:
            log.error(
                "evaluation of version %d ran past eval_timeout_s (%.0f s); cancelled",
                version,
                self.config.eval_timeout_s,
            )
            metrics = {"failed": 1.0, "timed_out": 1.0}
        except Exception as exc:  # a broken evaluation hook must not stop training; say so loudly
            log.error("evaluation of version %d failed: %s", version, "".join(traceback.format_exception(exc)))
            metrics = {"failed": 1.0}
        metrics["seconds"] = time.monotonic() - started
        await self._deliver(
            self.stub.ReportEval,
            controller_pb2.ReportEvalRequest(version=version, metrics=metrics, gateway_id=self.gateway_id),
            f"evaluation of version {version}",
        )

    # --- one row -------------------------------------------------------------------------------
    def _set_context_args(self) -> None:
        """Which context keyword arguments the rollout function declares (inspected once), and the dataset size
        that turns a row id into (epoch, cursor_index) when it asks for them."""
        self._group_fn = is_group_rollout(self.rollout_fn)
        self._context_args = declared_context_args(self.rollout_fn)
        needs_size = sorted(DATASET_CONTEXT_ARGS & set(self._context_args))
        if needs_size:
            from fleetrl.controller.dataset import load_rows

            if not self.run_cfg.dataset:
                raise ValueError(f"a rollout function that takes {' or '.join(needs_size)} needs run.dataset")
            self._num_rows = len(load_rows(self.run_cfg.dataset, self.run_cfg.max_rows))

    def _context(self, leased: Any, rollout_idx: int) -> dict[str, Any]:
        names = self._context_args
        if not names:
            return {}
        n = self._num_rows or 0
        index_in_epoch = leased.row_id % n if n else leased.row_id
        values = {
            "cursor_index": index_in_epoch,
            "epoch": leased.row_id // n if n else 0,
            "rollout_idx": rollout_idx,
            "evaluation": False,
            "row_id": leased.row_id,
            "submit_version": leased.submit_version,
            "attempt": leased.attempt,
            "row_index": index_in_epoch,
            "sample_index": rollout_idx,
            "end_of_epoch": bool(n) and index_in_epoch == n - 1,
        }
        return {name: values[name] for name in names}

    @property
    def min_group_size(self) -> int:
        """The gateway's own min_samples when set, else the run's min_group_size."""
        if "min_samples" in self.config.model_fields_set:
            return self.config.min_samples
        return self.run_cfg.min_group_size

    async def _run_members(self, row: dict[str, Any], leased: Any, members: list[int], retry: int = 0) -> list[Any]:
        """The results of group `members` (their rollout_idx); a retry samples with seeds of its own."""
        g = self.run_cfg.completions_per_prompt
        if self._group_fn:  # one call returns the whole group (fleetrl.tinker)
            key = self._rollout_key(leased, g * retry + members[0])
            out = await self.one_rollout(row, key, self._context(leased, 0), len(members))
            if isinstance(out, BaseException):
                return [out] * len(members)
            if not isinstance(out, list | tuple) or len(out) != len(members):
                got = f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, list | tuple) else "")
                raise RolloutReturnTypeError(f"a group rollout must return a list of {len(members)} results, got {got}")
            return list(out)
        calls = (
            self.one_rollout(row, self._rollout_key(leased, g * retry + i), self._context(leased, i)) for i in members
        )
        return list(await asyncio.gather(*calls))

    async def _group_results(self, row: dict[str, Any], leased: Any) -> list[Any]:
        """The G results of a row; members that produced no valid sample run again (max_incomplete_group_retries)
        while the group is short of min_group_size."""
        g = self.run_cfg.completions_per_prompt
        results = await self._run_members(row, leased, list(range(g)))
        for retry in range(1, self.run_cfg.max_incomplete_group_retries + 1):
            missing = [i for i, r in enumerate(results) if not _usable(r)]
            if not missing or g - len(missing) >= self.min_group_size:
                break
            if any(isinstance(results[i], NoReplicaError) for i in missing):
                break  # an outage: the row is reported FAILED and leased again, not patched up here
            self.counters["group_retries"] += 1
            again = await self._run_members(row, leased, missing if not self._group_fn else list(range(g)), retry)
            if self._group_fn:  # a group rollout scores the group together: take the new group whole
                results = again
                continue
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        return results

    async def process_row(self, leased: Any, lease_s: float = 0.0) -> None:
        """Run a leased row's group, send it to the trainer if accepted, report the outcome with the seconds of
        each phase (`lease`: the LeaseRows call that leased it, `rollouts`, `send`)."""
        started = time.monotonic()
        row = json.loads(leased.row_json)
        results = await self._group_results(row, leased)
        phase_s = {"lease": lease_s, "rollouts": time.monotonic() - started}
        assembled = assemble_group(
            leased.row_id,
            leased.submit_version,
            results,
            self.min_group_size,
            self.dynamic_filter,
            self.gateway_id,
            max_seq_len=resolve_max_seq_len(self.run_cfg),
            attempt=leased.attempt,
            vocab_size=self.vocab_size,
            lease_tag=leased.lease_tag,
            row=row,
        )
        self.counters.update({f"samples_dropped_{k}": v for k, v in assembled.dropped.items()})
        report = controller_pb2.RowReport(
            row_id=leased.row_id,
            samples=len(assembled.group.samples),
            samples_dropped=dict(assembled.dropped),
            min_version=assembled.min_version,
            attempt=leased.attempt,
            rewards=[float(s.reward) for s in assembled.group.samples],
        )
        too_large = self._too_large(assembled.group) if assembled.accepted else None
        if too_large is not None:
            # Deterministic (the same prompt gives groups as long again): closed as rejected, not retried.
            log.error("row %d: %s", leased.row_id, too_large)
            report.outcome, report.reason = controller_pb2.REJECTED, too_large
            self.counters["groups_too_large"] += 1
            self.counters["rows_rejected"] += 1
        elif assembled.accepted:
            try:
                t_send = time.monotonic()
                await self.send(assembled.group)
                phase_s["send"] = time.monotonic() - t_send
                report.phase_s.update(phase_s)
                report.outcome = controller_pb2.ACCEPTED
                self.counters["rows_accepted"] += 1
            except GroupStreamError as exc:
                log.warning("row %d: %s", leased.row_id, exc)
                report.outcome, report.reason = controller_pb2.FAILED, str(exc)
                self.counters["rows_failed"] += 1
        elif any(isinstance(r, NoReplicaError) for r in results):
            # Samples lost to an inference outage say nothing about the row: lease it again later.
            report.outcome, report.reason = controller_pb2.FAILED, f"no inference replica ({assembled.reason})"
            self.counters["rows_failed"] += 1
        else:
            report.outcome, report.reason = controller_pb2.REJECTED, assembled.reason
            self.counters["rows_rejected"] += 1
        await self._deliver(
            self.stub.ReportRows,
            controller_pb2.ReportRowsRequest(gateway_id=self.gateway_id, reports=[report]),
            f"row {leased.row_id}'s report",
        )
        self.counters["rows_done"] += 1
        self.row_seconds_sum += time.monotonic() - started
        self.row_latencies_s.append(time.monotonic() - started)

    def _too_large(self, group: Any) -> str | None:
        """Why `group` cannot reach the trainer (its message is over `max_group_mb`), or None."""
        from fleetrl.group_stream import group_to_proto

        size = group_to_proto(group).ByteSize()
        if size <= self.config.max_group_mb << 20:
            return None
        tokens = sum(len(s.tokens) for s in group.samples)
        return (
            f"group too large: its message is {size / 2**20:.1f} MiB ({len(group.samples)} samples, {tokens} tokens), "
            f"over the trainer's max_group_mb ({self.config.max_group_mb} MiB): cap the samples with run.max_seq_len "
            "(or raise max_group_mb on the trainer and the gateway)"
        )

    async def send(self, group: Any) -> None:
        if self._sender is None:
            raise GroupStreamError("no trainer group address from the controller yet")
        async with self._send_lock:  # one ZeroMQ socket: one sender at a time, off the event loop
            await asyncio.to_thread(self._sender.send, group)

    def _rollout_key(self, leased: Any, sample_index: int) -> RolloutKey:
        return RolloutKey(self.run_cfg.seed, leased.row_id, leased.submit_version, sample_index)

    async def one_rollout(
        self,
        row: dict[str, Any],
        key: RolloutKey | None = None,
        context: dict[str, Any] | None = None,
        group_size: int | None = None,
    ) -> Any:
        """One call of the user's rollout function (with the context keyword arguments it declares; with
        `group_size`, a group rollout's call for the whole group), retried on recoverable errors. With `key`, its
        sampling calls are seeded from it (fleetrl.gateway.sampling_seed); a retry starts from the same seeds, so a
        transport hiccup does not change what is sampled."""
        args: tuple[Any, ...] = (dict(row),) if group_size is None else (dict(row), group_size)
        async with self._slots:
            ticket = self.breaker.start()  # the breaker judges outcomes in start order
            for attempt in range(1, self.config.rollout_retries + 1):
                started = time.monotonic()
                try:
                    with rollout_seed_scope(key) if key is not None else contextlib.nullcontext():
                        result = await asyncio.wait_for(
                            self.rollout_fn(*args, **(context or {})), timeout=self.config.rollout_timeout_s
                        )
                except TimeoutError as exc:
                    if time.monotonic() - started >= self.config.rollout_timeout_s:
                        # The rollout's own deadline (wait_for cancelled it): a hung tool or environment. Not
                        # retried (it would hang again), dropped and counted.
                        self.counters["rollouts_timed_out"] += 1
                        log.warning(
                            "row %s: a rollout ran past rollout_timeout_s (%.0f s); cancelled and dropped",
                            key.row_id if key is not None else "?",
                            self.config.rollout_timeout_s,
                        )
                        return self._failed(exc, ticket)
                    if attempt < self.config.rollout_retries:  # e.g. a Generate call's own deadline
                        self.counters["rollouts_retried"] += 1
                        await asyncio.sleep(0.2 * 2 ** (attempt - 1))
                        continue
                    return self._failed(exc, ticket)
                except (NoReplicaError, grpc.aio.AioRpcError) as exc:
                    recoverable = not isinstance(exc, grpc.aio.AioRpcError) or exc.code() in RETRYABLE_CODES
                    if recoverable and attempt < self.config.rollout_retries:
                        self.counters["rollouts_retried"] += 1
                        await asyncio.sleep(0.2 * 2 ** (attempt - 1))
                        continue
                    if isinstance(exc, NoReplicaError):  # an outage: not the rollout function's failure
                        self.counters["rollouts_no_replica"] += 1
                        self.breaker.discard(ticket)
                        return exc
                    return self._failed(exc, ticket)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    return self._failed(exc, ticket)
                self.counters["rollouts_ok"] += 1
                self.breaker.record(True, ticket=ticket)
                return result
        raise AssertionError("unreachable")

    def _failed(self, exc: BaseException, ticket: int | None = None) -> BaseException:
        """Count and log a failed rollout; the breaker records it."""
        self.counters["rollouts_failed"] += 1
        kind = type(exc).__name__
        if kind not in self._seen_errors:  # the traceback once per error type, not once per sample
            self._seen_errors.add(kind)
            log.error("rollout raised %s (logged once):\n%s", kind, "".join(traceback.format_exception(exc)))
        self.breaker.record(False, f"{kind}: {exc}", ticket=ticket)
        return exc


def _reap(tasks: set[asyncio.Task[None]]) -> None:
    """Drop the finished tasks, raising what one raised (CircuitOpenError, a bug)."""
    for task in [t for t in tasks if t.done()]:
        tasks.discard(task)
        if not task.cancelled():  # cancelled: dropped when the controller stopped the run
            task.result()


def _idle_pause(reply: Any) -> float:
    """Seconds to wait before leasing again after a reply with no rows (None: the controller did not answer)."""
    if reply is None:
        return 0.5
    return min(max(reply.retry_after_s, 0.0), 0.2)


def _usable(result: Any) -> bool:
    """Whether a rollout result holds at least one valid sample (a wrong type is left for assembly to refuse)."""
    if isinstance(result, BaseException) or result is None:
        return False
    try:
        samples = rollout_result_samples(result)
    except (RolloutReturnTypeError, ValueError):
        return True
    return any(_valid(s) for s in samples or ())


def _valid(sample: Any) -> bool:
    from fleetrl.rollout import InvalidSampleError, validate_sample

    try:
        validate_sample(sample)
    except InvalidSampleError:
        return False
    return True
