"""How `fleetrl up` shares the machine's CPU cores between the services it starts on one machine.

Every torch process uses all cores by default. Two compute-bound processes that overlap in time (the trainer
training step k while an hf replica samples step k+1, which is the point of asynchronous training) then thrash:
on a 2-core machine one async run measured the trainer's forward/backward 9x slower than alone. So unless the
user set OMP_NUM_THREADS, each compute process gets its share through OMP_NUM_THREADS: half the cores to the
trainer (split across its ranks), the other half to the hf replicas and a reference service, at least one each;
the controller and gateways (I/O-bound) get one. vLLM replicas bind their own threads and are left alone. A
reference colocated in the trainer (reference_placement = "trainer", the default) is no sharer: its forward runs
in the trainer's own micro-batches, on the trainer's threads, so `reference` is True only for a reference service.

A strictly on-policy run (O = 0) without a reference service never trains while a replica samples: the replicas
sample a step's rollouts, then the trainer trains on them, then the next rollouts start from the new weights. Its
trainer gets every core (`on_policy`); the replicas keep their share, since they sample while the gateways and
the controller work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# oneMKL's conditions for bit-reproducible results from run to run (Intel's developer guide, "Obtaining Numerically
# Reproducible Results"): the thread count fixed at run time, so neither MKL nor OpenMP may pick fewer threads than
# asked (MKL_DYNAMIC, OMP_DYNAMIC; MKL's default lets it scale down, e.g. to what it detects as physical cores), and
# conditional numerical reproducibility on (MKL_CBWR=AUTO: one code path for the CPU whatever the data's alignment).
# torch's CPU GEMMs are MKL's. On a GPU these change nothing the training does.
REPRODUCIBLE_MATH_ENV = {"MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE", "MKL_CBWR": "AUTO"}


def reproducible_math_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of REPRODUCIBLE_MATH_ENV that `environ` (the user's) does not set: a user's own value wins."""
    return {k: v for k, v in REPRODUCIBLE_MATH_ENV.items() if k not in environ}


@dataclass(frozen=True)
class ThreadPlan:
    trainer: int  # per trainer rank
    inference: int  # per hf replica
    reference: int
    light: int = 1  # controller, gateways

    def env(self, service: str) -> dict[str, str]:
        """OMP_NUM_THREADS for `service`: trainer, inference, reference or light."""
        return {"OMP_NUM_THREADS": str(getattr(self, service))}


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_threads(
    cpus: int, *, trainer_procs: int, hf_replicas: int, reference: bool, on_policy: bool = False
) -> ThreadPlan:
    """Each compute process's OMP_NUM_THREADS for `cpus` cores (`reference`: a reference service runs; `on_policy`:
    O = 0, so training and sampling take turns)."""
    if cpus < 1 or trainer_procs < 1 or hf_replicas < 0:
        raise ValueError(f"bad layout: cpus={cpus}, trainer_procs={trainer_procs}, hf_replicas={hf_replicas}")
    sharers = hf_replicas + int(reference)
    trainer_share = cpus // 2 if sharers else cpus
    rest = cpus - trainer_share
    per_sharer = max(1, rest // sharers) if sharers else 1
    if on_policy and not reference:  # the replicas keep their share; the trainer runs while they wait
        trainer_share = cpus
    return ThreadPlan(
        trainer=max(1, trainer_share // trainer_procs),
        inference=per_sharer,
        reference=per_sharer,
    )
