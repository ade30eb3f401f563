"""The RL loop at scale, simulated: a discrete-event model of rollouts, training, publish, transfer, apply and the
off-policy gate (issue 39 item 6).

    python bench/pipeline_sim.py --validate /tmp/fleetrl-overlap-sim/pair-a --validate /tmp/fleetrl-overlap-sim/pair-b \
        --validate /tmp/fleetrl-overlap-sim/pair-c

(each DIR a `python bench/overlap.py --steps 10 --repeats 1 --cache DIR` run; without --validate, the projection
alone). Results and inputs: docs/benchmarks.md, "The loop at scale, simulated".

`simulate(LoopRates) -> LoopFigures` is pure (no I/O, no clock): it follows the controller's own rules.

- The gate (fleetrl.controller.gate): a row is admitted while `(v + O + 1) * P - accepted - reserved >= 1` (counted
  in rows, P rows a step), v the version every replica serves; the row's tokens come from v.
- The scheduler (`_accept`, `_form_steps`): a finished row is checked against the step it joins
  (`next_step - 1 - submit_version <= O`, else requeued: its reservation freed, leased again later); P accepted rows
  form a step.
- The loop (services/controller/orchestrator.py `train_and_publish`, `_run_push`, fleetrl.controller.push_queue):
  one TrainStep at a time; the version it trains is published at its end. Serial (O = 0 or
  `overlap_weight_push = false`): the loop awaits the push before the next TrainStep. Overlapped: the push runs beside
  the next steps, one in flight, a newer version supersedes one waiting; the gate opens at a version only once it is
  served.
- A push is a transfer, then an apply that pauses generation on the replicas (the swap). Where the push and training
  share a resource (two CPU cores here), each runs slower while the other runs: `train_contention` and
  `push_contention`, derived from the thread plan (`ONE_SHARED_CORE`) or measured from an overlapped run's component
  times (`contention_from_runs`), never fitted to the period.

`--validate DIR` reads the metrics.jsonl of a `bench/overlap.py` cache (DIR/serial-*/run, DIR/overlapped-*/run),
feeds the simulator the serial run's medians, and prints simulated vs measured step periods of both runs, the
overlapped one under no contention, one shared core (`ONE_SHARED_CORE`) and the contention measured in each pair
(`contention_from_runs`). It then prints the 8B / 32B / 70B projection (`project`), inputs from docs/benchmarks.md
(`H100`), and its sensitivity to the rollouts' length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class LoopRates:
    """What the simulated loop is fed: seconds per component, alone (no contention), and the run's shape."""

    train_s: float  # one TrainStep as the controller sees it, less the publish's stall
    rollout_s: float  # one row's group of rollouts, wall time
    transfer_s: float  # a version from the trainer to every replica (fetch and checks), alone
    apply_s: float = 0.0  # the replicas apply it; generation pauses meanwhile (the swap)
    publish_stall_s: float = 0.0  # the end of each TrainStep: the trainer stages the version (idle, not training)
    groups_per_step: int = 2  # P: rows a step trains
    max_offpolicy: int = 1  # O = max_head_offpolicy_versions
    overlap: bool = True  # overlap_weight_push (only with O >= 1, as the controller)
    max_rows_in_flight: int | None = None  # rows generated at once (max_concurrency / G); None: the gate alone
    train_contention: float = 0.0  # training runs 1 + this times slower while a transfer runs
    push_contention: float = 0.0  # a transfer runs 1 + this times slower while training runs
    steps: int = 40

    @property
    def overlapped(self) -> bool:
        return self.overlap and self.max_offpolicy >= 1


@dataclass
class LoopFigures:
    """What the simulated run did, with the same definitions as bench/overlap.py's figures."""

    step_ends: list[float] = field(default_factory=list)
    train_spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each TrainStep
    stall_s: float = 0.0  # the publish's stall at the end of each span
    push_spans: list[tuple[int, float, float]] = field(default_factory=list)  # (version, start, served)
    published_at: dict[int, float] = field(default_factory=dict)  # version -> end of the step that trained it
    push_wait_s: list[float] = field(default_factory=list)  # per step: the loop idle awaiting a push after it
    rollout_wait_s: list[float] = field(default_factory=list)  # per step: the loop idle before it, no step ready
    trained_offsets: list[list[int]] = field(default_factory=list)  # per step: each group's version offset
    rows_requeued_stale: int = 0
    superseded: int = 0
    versions_served: list[int] = field(default_factory=list)

    @property
    def period_s(self) -> float:
        """Median interval between step ends (bench/overlap.py's s/step)."""
        gaps = [b - a for a, b in zip(self.step_ends, self.step_ends[1:], strict=False)]
        return statistics.median(gaps) if gaps else math.nan

    def bench_idle_share(self) -> float:
        """bench/overlap.py's idle share: median push wait plus median rollout wait over steps 2..N, over the period."""
        push = statistics.median(self.push_wait_s[1:]) if len(self.push_wait_s) > 1 else 0.0
        rollout = statistics.median(self.rollout_wait_s[1:]) if len(self.rollout_wait_s) > 1 else 0.0
        return (push + rollout) / self.period_s

    def mean_period_s(self, skip: int = 1) -> float:
        """Mean seconds per step from the end of step `skip` to the last step's end (a pattern that alternates
        between two periods has a median that hides one of them)."""
        return (self.step_ends[-1] - self.step_ends[skip - 1]) / (len(self.step_ends) - skip)

    def version_latency_s(self) -> float:
        """Median seconds from a version's publish (the end of its step) to served by every replica."""
        values = [served - self.published_at[v] for v, _, served in self.push_spans]
        return statistics.median(values) if values else math.nan

    def idle_share(self, skip: int = 1) -> float:
        """The trainer's idle share (not training: waiting for rollouts or a push, or staging a version) from the
        end of step `skip` to the last step's end."""
        start, end = self.step_ends[skip - 1], self.step_ends[-1]
        busy = sum(max(min(e - self.stall_s, end) - max(s, start), 0.0) for s, e in self.train_spans)
        return max(1.0 - busy / (end - start), 0.0)

    @property
    def max_offset(self) -> int:
        return max((max(o) for o in self.trained_offsets if o), default=0)


class SimulationStuck(RuntimeError):
    """No event can happen: the rates and rules leave the loop waiting forever."""


def simulate(rates: LoopRates) -> LoopFigures:
    """Run `rates.steps` steps of the loop; pure and deterministic."""
    if min(rates.train_s, rates.rollout_s, rates.transfer_s, rates.apply_s, rates.publish_stall_s) < 0:
        raise ValueError("component times must be >= 0")
    groups, offpolicy = rates.groups_per_step, rates.max_offpolicy
    eps = 1e-12
    out = LoopFigures(stall_s=rates.publish_stall_s)
    t = 0.0
    served = 0  # the gate's version: what every replica serves
    accepted = reserved = 0  # rows, as the gate counts them
    rows: list[list[float]] = []  # in flight: [finish, submit_version, start]
    pause_until = 0.0  # generation paused by an apply (the swap)
    pending: list[int] = []  # accepted rows' offsets, waiting for P of them
    ready: list[list[int]] = []  # formed steps (their offsets)
    next_step = 1  # the step the next P accepted rows form
    trained = 0  # steps trained
    train: dict | None = None  # {"step", "left", "start", "offsets"}
    awaiting_push_since: float | None = None  # serial: the loop awaits this push
    idle_since = 0.0
    push: dict | None = None  # {"version", "phase", "left", "start"}
    waiting: int | None = None  # the version waiting for the push in flight (PushQueue.pending)

    def start_push(version: int) -> None:
        nonlocal push
        push = {"version": version, "phase": "transfer", "left": rates.transfer_s, "start": t}

    while trained < rates.steps:
        # The gate admits rows (one reservation each) at the served version.
        while (groups * (served + offpolicy + 1) - accepted - reserved >= 1) and (
            rates.max_rows_in_flight is None or reserved < rates.max_rows_in_flight
        ):
            begin = max(t, pause_until)
            rows.append([begin + rates.rollout_s, served, begin])
            reserved += 1
        # The loop takes the next step when it is free.
        if train is None and awaiting_push_since is None and ready:
            offsets = ready.pop(0)
            out.rollout_wait_s.append(t - idle_since)
            train = {
                "step": trained + 1,
                "left": rates.train_s + rates.publish_stall_s,
                "start": t,
                "offsets": offsets,
            }
        transferring = push is not None and push["phase"] == "transfer"
        train_slow = 1.0 + (rates.train_contention if transferring else 0.0)
        push_slow = 1.0 + (rates.push_contention if train is not None and transferring else 0.0)
        candidates = [r[0] for r in rows]
        if train is not None:
            candidates.append(t + train["left"] * train_slow)
        if push is not None:
            candidates.append(t + push["left"] * push_slow)
        if not candidates:
            raise SimulationStuck(f"at t={t:.3f}: served {served}, accepted {accepted}, trained {trained}")
        t_next = max(t, min(candidates))
        dt = t_next - t
        t = t_next
        if train is not None:
            train["left"] -= dt / train_slow
        if push is not None:
            push["left"] -= dt / push_slow
        # Rows that finished: `_accept` against the step they would join.
        finished = sorted((r for r in rows if r[0] <= t + eps), key=lambda r: r[0])
        rows = [r for r in rows if r[0] > t + eps]
        for _, submit, _ in finished:
            reserved -= 1
            offset = (next_step - 1) - int(submit)
            if offset > offpolicy:
                out.rows_requeued_stale += 1  # the reservation is freed; the row is leased again
                continue
            accepted += 1
            pending.append(offset)
            if len(pending) >= groups:
                ready.append(pending[:groups])
                pending = pending[groups:]
                next_step += 1
        # The push's phases.
        if push is not None and push["left"] <= eps:
            if push["phase"] == "transfer":
                push["phase"], push["left"] = "apply", rates.apply_s
                if rates.apply_s > 0:  # generation pauses: rows in flight finish that much later
                    for r in rows:
                        r[0] += rates.apply_s
                    pause_until = max(pause_until, t + rates.apply_s)
            if push["phase"] == "apply" and push["left"] <= eps:
                version = push["version"]
                out.push_spans.append((version, push["start"], t))
                out.versions_served.append(version)
                served = version  # scheduler.publish: the gate opens at it
                push = None
                if awaiting_push_since is not None:
                    out.push_wait_s.append(t - awaiting_push_since)
                    awaiting_push_since = None
                    idle_since = t
                    out.step_ends.append(t)
                elif waiting is not None:
                    start_push(waiting)
                    waiting = None
        if train is not None and train["left"] <= eps:
            version = train["step"]
            trained = version
            out.train_spans.append((train["start"], t))
            out.trained_offsets.append(train["offsets"])
            out.published_at[version] = t
            train = None
            if rates.overlapped:
                out.push_wait_s.append(0.0)
                out.step_ends.append(t)
                idle_since = t
                if push is None:
                    start_push(version)
                else:
                    if waiting is not None:
                        out.superseded += 1
                    waiting = version
            else:
                start_push(version)
                awaiting_push_since = t
    return out


# --- measured runs (bench/overlap.py's metrics.jsonl) -------------------------------------------------------------


def read_steps(metrics: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "perf/step_time" in r]


def measured(steps: list[dict[str, float]]) -> dict[str, float]:
    """bench/overlap.py's figures: medians over steps 2..N, the period over all step ends."""
    later = steps[1:]

    def med(key: str) -> float:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else math.nan

    ends = [r["time"] for r in steps]
    period = statistics.median(b - a for a, b in itertools.pairwise(ends))
    return {
        "period_s": period,
        "train_s": med("perf/train_time"),
        "rollout_s": med("perf/rollout_time"),
        "push_s": med("perf/push_wait_time"),
        "fetch_s": med("perf/weight_fetch_time"),
        "swap_s": med("perf/weight_swap_time"),
        "serve_s": med("perf/version_serve_time"),
        "train_wait_s": med("perf/train_wait_time"),
        "idle_share": (med("perf/push_wait_time") + med("perf/train_wait_time")) / period,
        "steps": float(len(steps)),
    }


# `fleetrl up` on 2 cores gives the trainer process one core (fleetrl/up/cpu_threads.py). While a version travels,
# the trainer's own process serves it (the stream's checksums and ZeroMQ sends), so its training thread and that
# sender share the core: each runs at half speed (a contention of 1) when the sender is the transfer's bottleneck.
# Derived from the thread plan, before looking at any overlapped run.
ONE_SHARED_CORE = (1.0, 1.0)


def contention_from_runs(serial: dict[str, float], overlapped: dict[str, float]) -> tuple[float, float]:
    """The two contention factors, from component times (not the period): a transfer alone takes the serial run's
    push minus its swap; beside training it took the overlapped run's serve time minus the swap, so it ran
    1 + push_contention slower; the overlapped TrainStep took longer than the serial one by the training it lost
    during that transfer, so `train_s + x * c / (1 + c) = overlapped train_s`, x the transfer's time beside it."""
    transfer = max(serial["push_s"] - serial["swap_s"], 1e-9)
    beside = max(overlapped["serve_s"] - serial["swap_s"], transfer)
    push_c = beside / transfer - 1.0
    lost = min(max(overlapped["train_s"] - serial["train_s"], 0.0) / beside, 0.95)
    return lost / (1.0 - lost), push_c


def rates_from_serial(serial: dict[str, float], contention: tuple[float, float] = (0.0, 0.0)) -> LoopRates:
    """The serial run's medians as bench/overlap.py runs it (P = 2, O = 1), with a (train, push) contention."""
    return LoopRates(
        train_s=serial["train_s"],
        rollout_s=serial["rollout_s"],
        transfer_s=serial["push_s"] - serial["swap_s"],
        apply_s=serial["swap_s"],
        groups_per_step=2,
        max_offpolicy=1,
        train_contention=contention[0],
        push_contention=contention[1],
        steps=int(serial["steps"]),
    )


def load_pair(cache: Path) -> tuple[dict[str, float], dict[str, float]]:
    serial = measured(read_steps(sorted(cache.glob("serial-*/run/metrics.jsonl"))[0]))
    overlapped = measured(read_steps(sorted(cache.glob("overlapped-*/run/metrics.jsonl"))[0]))
    return serial, overlapped


# --- the projection: 8B, 32B, 70B ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """Rates measured in docs/benchmarks.md ("On a GPU: an H100, 2026-11-26")."""

    train_tokens_per_s_1p5b: float = 18_502.0  # mixed precision, packed, checkpointing, 2 x 4096, 1.54B params
    params_1p5b: float = 1.54e9
    pinned_copy_bytes_per_s: float = 54.8 * GB  # device to reused pinned host buffers
    pageable_gather_bytes_per_s: float = 1.5 * GB  # device to fresh pageable host memory (today's full fp32 gather)
    load_bytes_per_s: float = 7.7 * GB  # a fetched version loaded onto cuda


H100 = Measured()


@dataclass(frozen=True)
class Scale:
    name: str
    params: float
    trainer_gpus: int
    replica_tp: int


SCALES = (Scale("8B", 8.2e9, 8, 1), Scale("32B", 32.8e9, 32, 4), Scale("70B", 70.6e9, 64, 8))
STEP_TOKENS = 256 * 4096  # B = 256 samples (P = 32 x G = 8) of 4,096 tokens


@dataclass(frozen=True)
class Projection:
    scale: str
    offpolicy: int
    link_gbit: float
    path: str
    figures: LoopFigures
    rates: LoopRates
    trainer_host_gb: float
    trainer_device_gib: float
    replica_device_gib: float


def project(
    scale: Scale,
    offpolicy: int,
    link_gbit: float,
    path: str = "bucketed",
    rollout_to_train: float = 1.0,
    measured_rates: Measured = H100,
    steps: int = 40,
) -> Projection:
    """One cell of the projection. `path`: "bucketed" (item 2 and 3's design: each bucket gathered, cast and copied
    once, `weight_bytes / pinned copy` of stall; one copy per link, NCCL-style) or "today" (the whole fp32 state dict
    gathered into rank 0's pageable memory: `4 * params / 1.5 GB/s` of stall, every rank waiting).
    `rollout_to_train`: one row's rollouts take this many train steps (1.0: a fleet sized to keep pace)."""
    bf16 = 2 * scale.params
    per_gpu = measured_rates.train_tokens_per_s_1p5b * measured_rates.params_1p5b / scale.params  # 6N, equal MFU
    compute_s = STEP_TOKENS / (per_gpu * scale.trainer_gpus)
    if path == "bucketed":
        stall_s = bf16 / measured_rates.pinned_copy_bytes_per_s
    elif path == "today":
        stall_s = 4 * scale.params / measured_rates.pageable_gather_bytes_per_s
    else:
        raise ValueError(f"unknown path {path!r}")
    rates = LoopRates(
        train_s=compute_s,
        publish_stall_s=stall_s,
        rollout_s=rollout_to_train * compute_s,
        transfer_s=bf16 / (link_gbit * GB / 8),
        apply_s=bf16 / scale.replica_tp / measured_rates.load_bytes_per_s,
        groups_per_step=32,
        max_offpolicy=offpolicy,
        overlap=True,
        steps=steps,
    )
    figures = simulate(rates)
    keep = 3 if offpolicy >= 1 else 2  # the trainer's weight stream: in flight, waiting, newest (docs/weights.md)
    host = (keep + 1) * bf16  # plus the staged version (fleetrl.weights.publisher)
    states = 16 * scale.params / scale.trainer_gpus  # fp32 weights and grads, AdamW's two moments, sharded
    if path == "today":
        host += 4 * scale.params  # the full fp32 state dict on rank 0
        receive = bf16  # every receiving rank allocates the whole version
    else:
        receive = 2 * 64 * 2**20  # two 64 MiB buckets (double-buffered broadcast)
    return Projection(
        scale=scale.name,
        offpolicy=offpolicy,
        link_gbit=link_gbit,
        path=path,
        figures=figures,
        rates=rates,
        trainer_host_gb=host / GB,
        trainer_device_gib=states / GIB,
        replica_device_gib=(bf16 / scale.replica_tp + receive) / GIB,
    )


# --- the command --------------------------------------------------------------------------------------------------


def _pct(sim: float, real: float) -> str:
    return f"{100 * (sim - real) / real:+.1f} %"


def validation_rows(pairs: dict[str, tuple[dict[str, float], dict[str, float]]]) -> list[str]:
    """Each pair's serial run's medians predict that pair's serial and overlapped runs; the overlapped one under each
    contention: none, one shared core (derived), and the one measured in each pair (itself and the others)."""
    lines = [
        "| pair | mode | contention (train, push): from | simulated s/step | measured s/step | error | "
        "simulated serve s | measured serve s | simulated idle | measured idle |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    measured_c = {name: contention_from_runs(*pair) for name, pair in pairs.items()}
    for name, (serial, overlapped) in pairs.items():
        variants = [("-", (0.0, 0.0), False, serial), ("none", (0.0, 0.0), True, overlapped)]
        variants.append(("one shared core", ONE_SHARED_CORE, True, overlapped))
        variants += [(f"measured in {src}", c, True, overlapped) for src, c in measured_c.items()]
        for source, contention, overlap, real in variants:
            figures = simulate(replace(rates_from_serial(serial, contention), overlap=overlap))
            label = source if source == "-" else f"{contention[0]:.2f}, {contention[1]:.2f}: {source}"
            lines.append(
                f"| {name} | {'overlapped' if overlap else 'serial'} | {label} | {figures.period_s:.2f} | "
                f"{real['period_s']:.2f} | {_pct(figures.period_s, real['period_s'])} | "
                f"{figures.version_latency_s():.2f} | {real['serve_s']:.2f} | "
                f"{100 * figures.bench_idle_share():.0f} % | {100 * real['idle_share']:.0f} % |"
            )
    return lines


def projection_rows(projections: list[Projection]) -> list[str]:
    lines = [
        "| model | publish path | O | link | train + stall s | transfer + apply s | step period s | trainer idle | "
        "version latency s | max offset | trainer host GB (rank 0) | trainer device GiB/rank | "
        "replica device GiB/rank |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in projections:
        f, r = p.figures, p.rates
        lines.append(
            f"| {p.scale} | {p.path} | {p.offpolicy} | {p.link_gbit:.0f} Gbit/s | "
            f"{r.train_s:.1f} + {r.publish_stall_s:.2f} | "
            f"{r.transfer_s:.2f} + {r.apply_s:.2f} | {f.mean_period_s(5):.1f} | {100 * f.idle_share(5):.1f} % | "
            f"{f.version_latency_s():.2f} | {f.max_offset} | {p.trainer_host_gb:.0f} | {p.trainer_device_gib:.1f} | "
            f"{p.replica_device_gib:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validate", type=Path, action="append", default=[], help="a bench/overlap.py cache")
    args = parser.parse_args(argv)
    if args.validate:
        pairs = {cache.name: load_pair(cache) for cache in args.validate}
        for cache, (serial, over) in pairs.items():
            for mode, m in (("serial", serial), ("overlapped", over)):
                print(f"# {cache} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
        print("\n".join(validation_rows(pairs)))
        print()
    projections = [
        project(scale, offpolicy, link) for scale in SCALES for link in (100, 400) for offpolicy in (0, 1, 2)
    ]
    projections += [project(scale, offpolicy, 400, path="today") for scale in SCALES for offpolicy in (0, 1)]
    print("\n".join(projection_rows(projections)))
    print()
    for rollout_to_train in (0.5, 0.8, 1.0, 1.2):  # 70B, 100 Gbit/s: how O = 1's idle share grows with the rollouts
        cells = []
        for offpolicy in (1, 2):
            figures = project(SCALES[2], offpolicy, 100, rollout_to_train=rollout_to_train).figures
            cells.append(
                f"O = {offpolicy}: {figures.mean_period_s(5):.1f} s/step, idle {100 * figures.idle_share(5):.1f} %"
            )
        print(f"# 70B, 100 Gbit/s, rows of {rollout_to_train} x a step's training: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
