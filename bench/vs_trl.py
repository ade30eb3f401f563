"""fleetrl vs TRL's `GRPOTrainer`, side by side on the arithmetic main job (issue 19).

    pip install -c constraints-cpu.txt -e '.[bench-trl]'     # TRL 1.16.0, torch kept at the pinned CPU wheel
    python bench/vs_trl.py [--workload compute|tool] [--steps N] [--repeats 3] [--arms a,b] [--cache /tmp]

Every arm trains the same warm-started model (examples/arithmetic/warm_start.py, built once and cached under
CACHE/fleetrl-vstrl/init) on the same train rows with the example's exact-match reward: P = 16 prompts x G = 8
completions, 5 new tokens, T = 1, lr 3e-4 (5 warm-up steps), grad clip 1.0, no KL. Arms run round-robin (arm 1..k,
then again, `--repeats` times), each in its own process:

  compute (default 100 steps): trl (GRPOTrainer, synchronous, one process), fleetrl_sync (`fleetrl up`,
      synchronous_training = true), fleetrl_o1 (`fleetrl up`, max_head_offpolicy_versions = 1), limit (bare
      generate + one fwd/bwd/AdamW step a step, bench/vs_trl_limit.py).
  tool (default 50 steps): each completion also awaits a 0.2 s tool call: trl (async reward), fleetrl_sync,
      fleetrl_o1, fleetrl_o2, fleetrl_o2_c256 (O = 2, max_concurrency = 256).
  opt-in, either workload (`--arms trl_t1,limit_t1`): trl and limit with OMP_NUM_THREADS=1, as `fleetrl up` gives
      each of its compute processes on 2 cores (steady on a loaded machine, where 2-thread torch is not).

s/step is (last step end - first step end) / (steps - 1) of one run (the first step excluded); the table gives the
median [min, max] over repeats, completions/s = 128 / median s/step, vs TRL = TRL's median s/step / the arm's.
"median step s" is the median interval between consecutive step ends: robust to bursts of load from other work on a
shared machine, which the span-based s/step is not (both are given, and vs TRL for both); "p10 step s", the 10th
percentile interval, estimates a step on a quiet machine. For the limit arm s/step is
the sum of the median generate and median train times. `--retable JSON` rebuilds the table from the run folders.
Start to first step is from launching the process to the first step's end; last step to exit from the last step's
end to the process exit (TRL and fleetrl both save the final model in that time). Held-out greedy / sampled accuracy
comes from one evaluator for every arm (bench/vs_trl_eval.py on the arm's final model; median over repeats). For
fleetrl arms the medians of the perf/* metrics of metrics.jsonl are listed too. Writes --json and prints markdown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
COMPLETIONS = 16 * 8

FLEETRL_ARMS: dict[str, dict] = {
    "fleetrl_sync": {"synchronous_training": True},
    "fleetrl_o1": {"max_head_offpolicy_versions": 1},
    "fleetrl_o2": {"max_head_offpolicy_versions": 2},
    "fleetrl_o2_c256": {"max_head_offpolicy_versions": 2, "max_concurrency": 256},
}
WORKLOADS = {
    "compute": {"arms": ["trl", "fleetrl_sync", "fleetrl_o1", "limit"], "steps": 100, "tool_latency": 0.0},
    "tool": {
        "arms": ["trl", "fleetrl_sync", "fleetrl_o1", "fleetrl_o2", "fleetrl_o2_c256"],
        "steps": 50,
        "tool_latency": 0.2,
    },
}
LABELS = {
    "trl": "TRL GRPOTrainer (synchronous, one process)",
    "fleetrl_sync": "fleetrl sync",
    "fleetrl_o1": "fleetrl async O = 1",
    "fleetrl_o2": "fleetrl async O = 2",
    "fleetrl_o2_c256": "fleetrl async O = 2, max_concurrency = 256",
    "limit": "limit: bare generate + fwd/bwd/AdamW, serial",
    "trl_t1": "TRL GRPOTrainer, OMP_NUM_THREADS=1",
    "limit_t1": "limit, OMP_NUM_THREADS=1",
}
# Opt-in arms (--arms): one torch thread, as `fleetrl up` gives each of its processes on 2 cores; on a loaded
# machine a 2-thread torch process loses far more than a 1-thread one (its threads wait for each other).
ONE_THREAD = {"trl_t1": "trl", "limit_t1": "limit"}


def warm_start(cache: Path) -> Path:
    """The example's warm-started model and rows, built once (~80 s) under `cache` and reused."""
    init = cache / "fleetrl-vstrl" / "init"
    if not (init / "done.json").exists():
        cmd = [sys.executable, str(REPO / "examples" / "arithmetic" / "warm_start.py"), "--out", str(init)]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        (init / "done.json").write_text(json.dumps({"built": time.time()}))
    return init


def fleetrl_config(init: Path, log: Path, arm: str, steps: int, tool_latency: float) -> dict:
    """The example's run.toml as a config dict (no in-run evaluation: every arm is evaluated afterwards alike)."""
    run = {
        "base_model": str(init / "model"),
        "dataset": str(init / "train.jsonl"),
        "log_path": str(log),
        "seed": 0,
        "completions_per_prompt": 8,
        "prompt_groups_per_step": 16,
        "max_steps": steps,
        "max_completion_tokens": 5,
        "max_seq_len": 16,
        "temperature": 1.0,
        "policy_loss": "grpo",
        "kl_beta": 0.0,
        "learning_rate": 3e-4,
        "lr_warmup_steps": min(5, steps),
        "grad_clip_norm": 1.0,
        **FLEETRL_ARMS[arm],
    }
    if tool_latency > 0:
        run["rollout_extras"] = {"tool_latency_s": tool_latency}
        rollout = f"{BENCH / 'vs_trl_rollout.py'}:make_tool_rollout_fn"
    else:
        rollout = f"{REPO / 'examples' / 'arithmetic' / 'rollout.py'}:make_rollout_fn"
    return {"run": run, "up": {"rollout": rollout, "engine": "hf", "replicas": 1, "gateways": 1}}


def launch(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run `cmd` to completion (its output to out/stdout.log); wall time at launch and at exit."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.log", "w") as log:
        t0 = time.time()
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        t1 = time.time()
    if rc != 0:
        tail = (out / "stdout.log").read_text()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}):\n{tail}")
    return t0, t1


def timing(launched: float, exited: float, ends: list[float]) -> dict:
    """One run's step timings from the wall time of each step's end (the first step is excluded from the rates)."""
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "s_per_step": (ends[-1] - ends[0]) / (len(ends) - 1),
        "step_s_median": statistics.median(intervals),
        "step_s_p10": statistics.quantiles(intervals, n=10)[0] if len(intervals) > 1 else intervals[0],
        "start_to_first_step_s": ends[0] - launched,
        "last_step_to_exit_s": exited - ends[-1],
        "steps": len(ends),
        "launched": launched,
        "exited": exited,
    }


def collect(arm: str, out: Path, launched: float, exited: float) -> dict:
    """One finished run's timings (and for fleetrl its perf/* medians) read back from its folder."""
    arm = ONE_THREAD.get(arm, arm)
    if arm in ("trl", "limit"):
        record = json.loads((out / "steps.json").read_text())
        result = timing(launched, exited, record["steps"])
        if arm == "limit":  # no framework: the sum of the phases' medians, and the median step
            result["generate_s"] = statistics.median(record["generate_s"][1:])
            result["train_s"] = statistics.median(record["train_s"][1:])
            result["s_per_step"] = result["generate_s"] + result["train_s"]
            phases = zip(record["generate_s"][1:], record["train_s"][1:], strict=True)
            totals = [g + t for g, t in phases]
            result["step_s_median"] = statistics.median(totals)
            result["step_s_p10"] = statistics.quantiles(totals, n=10)[0] if len(totals) > 1 else totals[0]
            return result
        return {**result, "model": str(out / "final")}
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in records if r.get("step", 0) >= 1 and any(k.startswith("perf/") for k in r)]
    result = timing(launched, exited, [r["time"] for r in steps_rows])
    perf_keys = sorted({k for r in steps_rows for k in r if k.startswith("perf/")})
    result["perf"] = {
        k: statistics.median(r[k] for r in steps_rows[1:] if isinstance(r.get(k), int | float)) for k in perf_keys
    }
    return {**result, "model": str(out / "run" / "final")}


def run_arm(arm: str, init: Path, out: Path, steps: int, tool_latency: float) -> dict:
    """One run of one arm in its own process(es): `fleetrl up` for fleetrl arms, a bench script for the others."""
    kind, env = ONE_THREAD.get(arm, arm), None
    if arm in ONE_THREAD:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kind in ("trl", "limit"):
        script = BENCH / ("vs_trl_trl.py" if kind == "trl" else "vs_trl_limit.py")
        cmd = [sys.executable, str(script), "--init", str(init), "--out", str(out), "--steps", str(steps)]
        if kind == "trl":
            cmd += ["--tool-latency", str(tool_latency)]
    else:
        out.mkdir(parents=True, exist_ok=True)
        config = out / "config.json"
        config.write_text(json.dumps(fleetrl_config(init, out / "run", arm, steps, tool_latency)))
        cmd = [sys.executable, "-m", "fleetrl", "up", str(config), "--overwrite"]
    launched, exited = launch(cmd, out, env)
    return collect(arm, out, launched, exited)


def retable(path: Path, work: Path) -> dict[str, list[dict]]:
    """A results file's runs re-read from their folders (WORK/ARM-REP), keeping the stored accuracies."""
    results = json.loads(path.read_text())["results"]
    for arm, runs in results.items():
        for rep, old in enumerate(runs):
            launched = old.get("launched")
            if launched is None:  # files written before launch times were stored
                first = collect(arm, work / f"{arm}-{rep}", 0.0, 0.0)
                ends_first = first["start_to_first_step_s"]  # launched = 0: the first step's wall time
                ends_last = -first["last_step_to_exit_s"]
                launched = ends_first - old["start_to_first_step_s"]
                exited = ends_last + old["last_step_to_exit_s"]
            else:
                exited = old["exited"]
            fresh = collect(arm, work / f"{arm}-{rep}", launched, exited)
            runs[rep] = {**fresh, **{k: old[k] for k in ("greedy", "sampled") if k in old}}
    return results


def evaluate(model: str, init: Path) -> dict:
    cmd = [sys.executable, str(BENCH / "vs_trl_eval.py"), model, str(init / "eval.jsonl")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def table(results: dict[str, list[dict]]) -> str:
    """The markdown tables: one row per arm, then the fleetrl arms' perf/* medians."""

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    trl = results.get("trl")
    lines = [
        "| arm | s/step | median step s | p10 step s | completions/s | vs TRL (s/step; median step) "
        "| start to first step s | last step to exit s | held-out greedy / sampled |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, runs in results.items():
        sps = [r["s_per_step"] for r in runs]
        vs = f"{med(trl, 's_per_step') / med(runs, 's_per_step'):.2f}x; " if trl else ""
        vs += f"{med(trl, 'step_s_median') / med(runs, 'step_s_median'):.2f}x" if trl else ""
        label = LABELS[arm]
        if "generate_s" in runs[0]:
            gen, train = spread([r["generate_s"] for r in runs]), spread([r["train_s"] for r in runs])
            label += f" (generate {gen} + train {train})"
        acc = ""
        if all("greedy" in r for r in runs):
            acc = f"{med(runs, 'greedy'):.3f} / {med(runs, 'sampled'):.3f}"
        steps = spread([r["step_s_median"] for r in runs])
        p10 = spread([r["step_s_p10"] for r in runs])
        first = spread([r["start_to_first_step_s"] for r in runs], "{:.1f}")
        last = spread([r["last_step_to_exit_s"] for r in runs], "{:.1f}")
        rate = COMPLETIONS / statistics.median(sps)
        row = [label, spread(sps), steps, p10, f"{rate:.0f}", vs, first, last, acc]
        lines.append("| " + " | ".join(row) + " |")
    fleet = [arm for arm in results if arm.startswith("fleetrl")]
    if fleet:
        keys = sorted({k for arm in fleet for r in results[arm] for k in r["perf"]})
        lines += ["", "| perf/* (median of steps 2..N; median over runs) | " + " | ".join(fleet) + " |"]
        lines.append("| --- |" + " --- |" * len(fleet))
        for k in keys:
            cells = [
                f"{statistics.median(r['perf'][k] for r in results[arm] if k in r['perf']):.4g}"
                if any(k in r["perf"] for r in results[arm])
                else ""
                for arm in fleet
            ]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="compute")
    parser.add_argument("--steps", type=int, help="steps per run (default: 100 compute, 50 tool)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", help="comma-separated subset of the workload's arms")
    parser.add_argument("--tool-latency", type=float, help="seconds per tool call (tool workload; default 0.2)")
    parser.add_argument("--cache", default="/tmp", help="folder for the cached warm start and the runs")
    parser.add_argument("--json", help="results file (default CACHE/fleetrl-vstrl/vs_trl_WORKLOAD.json)")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    parser.add_argument("--retable", metavar="JSON", help="re-read a results file's runs from their folders, no runs")
    args = parser.parse_args(argv)
    spec = WORKLOADS[args.workload]
    arms = args.arms.split(",") if args.arms else spec["arms"]
    unknown = [a for a in arms if a not in [*spec["arms"], *ONE_THREAD]]
    if unknown:
        parser.error(f"arms {unknown} are not in the {args.workload} workload's {spec['arms']}")
    steps = args.steps or spec["steps"]
    latency = spec["tool_latency"] if args.tool_latency is None else args.tool_latency
    cache = Path(args.cache)
    work = cache / "fleetrl-vstrl" / args.workload
    if args.retable:
        results = retable(Path(args.retable), work)
        Path(args.retable).write_text(json.dumps({**json.loads(Path(args.retable).read_text()), "results": results}))
        print(table(results))
        return 0
    init = warm_start(cache)
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for rep in range(args.repeats):
        for arm in arms:
            result = run_arm(arm, init, work / f"{arm}-{rep}", steps, latency)
            if "model" in result and not args.no_eval:
                result.update(evaluate(result["model"], init))
            results[arm].append(result)
            print(f"repeat {rep} {arm}: {result['s_per_step']:.3f} s/step", file=sys.stderr, flush=True)
    path = Path(args.json) if args.json else cache / "fleetrl-vstrl" / f"vs_trl_{args.workload}.json"
    meta = {"workload": args.workload, "steps": steps, "repeats": args.repeats, "tool_latency_s": latency}
    path.write_text(json.dumps({**meta, "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
