"""Which GPUs the trainer, the inference replicas and a reference service take, and the one rule across them:
none shared.

A GPU in two lists holds the trainer's shards and optimizer state and a replica's weights and KV cache (or the
reference's frozen copy) at once: an out-of-memory at best, a service slowing every step at worst. `fleetrl up`
checks its `trainer_gpus`, `inference_gpus` and `reference_gpus`; docker compose hands the containers
FLEETRL_TRAINER_GPUS, FLEETRL_INFERENCE_GPUS and FLEETRL_REFERENCE_GPUS (comma-separated ids) and the trainer and
inference launchers check them (`check_gpu_env`) before loading anything. The reference's ids count only when the
reference is a service (FLEETRL_REFERENCE is not `local`): a colocated reference lives on the trainer's GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

TRAINER_GPUS_ENV = "FLEETRL_TRAINER_GPUS"
INFERENCE_GPUS_ENV = "FLEETRL_INFERENCE_GPUS"
REFERENCE_GPUS_ENV = "FLEETRL_REFERENCE_GPUS"
REFERENCE_ENV = "FLEETRL_REFERENCE"  # the trainer's --reference: `local` (colocated) or the service's HOST:PORT


def parse_gpu_ids(text: str, field: str) -> list[int]:
    """'0,1, 2' as [0, 1, 2]; an empty string as []. A non-integer id fails naming `field`."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.append(int(part))
        except ValueError:
            raise ValueError(f"{field}: {part!r} is not a GPU id (give comma-separated integers, e.g. 0,1)") from None
    return ids


def check_disjoint_gpus(
    trainer_gpus: Iterable[int], inference_gpus: Iterable[int], trainer_field: str, inference_field: str
) -> None:
    """Fail naming both fields and the shared ids when a GPU is in both lists."""
    check_gpu_lists({trainer_field: trainer_gpus, inference_field: inference_gpus})


def check_gpu_lists(lists: Mapping[str, Iterable[int]]) -> None:
    """Fail naming the first two fields (in `lists`' order) that share a GPU, and the shared ids."""
    named = [(field, set(ids)) for field, ids in lists.items()]
    for i, (first, first_ids) in enumerate(named):
        for second, second_ids in named[i + 1 :]:
            shared = sorted(first_ids & second_ids)
            if shared:
                raise ValueError(
                    f"{first} and {second} overlap on GPU {', '.join(map(str, shared))}: the trainer, inference "
                    "and a reference service must not share a GPU (give each its own ids)"
                )


def check_gpu_env(env: Mapping[str, str]) -> None:
    """Compose's check: FLEETRL_TRAINER_GPUS, FLEETRL_INFERENCE_GPUS and, when the reference is a service
    (FLEETRL_REFERENCE set and not `local`), a non-empty FLEETRL_REFERENCE_GPUS share no id."""
    lists = {name: parse_gpu_ids(env[name], name) for name in (TRAINER_GPUS_ENV, INFERENCE_GPUS_ENV) if name in env}
    if env.get(REFERENCE_ENV, "local") != "local" and env.get(REFERENCE_GPUS_ENV):
        lists[REFERENCE_GPUS_ENV] = parse_gpu_ids(env[REFERENCE_GPUS_ENV], REFERENCE_GPUS_ENV)
    check_gpu_lists(lists)
