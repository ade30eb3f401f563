"""Where the KL reference runs: a colocated frozen copy in the trainer vs the reference service, per step.

    python bench/reference_placement.py [--rounds 3] [--json out.json]

One `PolicyTrainer.train_step` of 16 long-tailed samples (bench/trainer_packing.py's mix, 7,696 trained
positions) on a random Qwen2-shaped model (hidden 256, 4 layers, vocabulary 16,384), in three configurations, rounds
interleaved after a warm-up each:
- no KL (kl_beta = 0): the step without any reference;
- colocated: `--reference local`, the frozen copy's forward in the trainer's own micro-batches;
- service: `fleetrl serve reference` as its own process, its forward overlapping the step (the trainer waits for it
  only after its first micro-batch's forward).
The trainer gets one core (torch threads = 1) and the service process the other (OMP_NUM_THREADS = 1): the
2-core stand-in for "the reference on its own device" vs "on the trainer's". Reported per configuration: the
step's wall seconds, the reference's forward seconds and the trainer's wait for it (`perf/ref_wait_time`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer_packing import LONG_TAIL, build_model, groups_of


def start_reference(model_dir: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    from fleetrl.ready_file import wait_ready_file

    ready = workdir / "reference.ready.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fleetrl", "serve", "reference", "--model", model_dir, "--grpc-port", "0"]
    cmd += ["--metrics-port", "0", "--ready-file", str(ready), "--max-batch-tokens", "65536"]
    log = (workdir / "reference.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    info = wait_ready_file(ready, 120.0, process=proc)
    return proc, f"127.0.0.1:{info['grpc_port']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    from fleetrl import Config
    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer.reference_source import make_reference_fn
    from fleetrl.trainer.row_set import RowIdSet

    torch.set_num_threads(1)
    vocab = 16384
    work = Path(tempfile.mkdtemp(prefix="fleetrl-refplace-"))
    model_dir = build_model(work / "model", vocab=vocab, hidden=256, layers=4)
    groups = groups_of(LONG_TAIL, vocab)
    proc, address = start_reference(model_dir, work)
    try:

        def cfg(name: str, kl: float) -> Config:
            return Config(
                base_model=model_dir,
                log_path=str(work / name),
                completions_per_prompt=4,
                prompt_groups_per_step=len(LONG_TAIL) // 4,
                max_completion_tokens=8000,
                max_seq_len=8192,
                kl_beta=kl,
            )

        service_cfg = cfg("service", 0.01)
        trainers = {
            "no KL": PolicyTrainer(cfg("none", 0.0), refuse_stale=False),
            "colocated": PolicyTrainer(cfg("colocated", 0.01), refuse_stale=False, colocated_reference=True),
            "service": PolicyTrainer(
                service_cfg,
                refuse_stale=False,
                ref_logprobs_fn=make_reference_fn(address, service_cfg, auth_token=None, timeout_s=600, device="cpu"),
            ),
        }
        rows: dict[str, dict[str, list[float]]] = {a: {"step": [], "ref_forward": [], "ref_wait": []} for a in trainers}
        for round_ in range(args.rounds + 1):
            for arm, trainer in trainers.items():
                started = time.perf_counter()
                metrics = trainer.train_step(groups, step=trainer.steps_done + 1).metrics
                trainer._trained_rows = RowIdSet()
                wall = time.perf_counter() - started
                print(f"round {round_} {arm}: {wall:.2f} s", flush=True)
                if round_:
                    rows[arm]["step"].append(wall)
                    rows[arm]["ref_forward"].append(metrics.get("perf/ref_forward_time", 0.0))
                    rows[arm]["ref_wait"].append(metrics.get("perf/ref_wait_time", 0.0))
        result = {
            arm: {key: statistics.median(values) for key, values in figures.items()} for arm, figures in rows.items()
        }
        result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"  # type: ignore[assignment]
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
