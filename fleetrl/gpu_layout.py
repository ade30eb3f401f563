"""Which GPUs the trainer and the inference replicas take, and the one rule across them: none shared.

A GPU in both lists holds the trainer's shards and optimizer state and a replica's weights and KV cache at once:
an out-of-memory at best, a replica slowing every step at worst. `fleetrl up` checks its `trainer_gpus` and
`inference_gpus`; docker compose hands the containers FLEETRL_TRAINER_GPUS and FLEETRL_INFERENCE_GPUS
(comma-separated ids) and the trainer and inference launchers check them (`check_gpu_env`) before loading anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

TRAINER_GPUS_ENV = "FLEETRL_TRAINER_GPUS"
INFERENCE_GPUS_ENV = "FLEETRL_INFERENCE_GPUS"


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
    shared = sorted(set(trainer_gpus) & set(inference_gpus))
    if shared:
        raise ValueError(
            f"{trainer_field} and {inference_field} overlap on GPU {', '.join(map(str, shared))}: the trainer and "
            "inference must not share a GPU (give each its own ids)"
        )


def check_gpu_env(env: Mapping[str, str]) -> None:
    """Compose's check: FLEETRL_TRAINER_GPUS and FLEETRL_INFERENCE_GPUS, where both are set, share no id."""
    trainer, inference = env.get(TRAINER_GPUS_ENV), env.get(INFERENCE_GPUS_ENV)
    if trainer is None or inference is None:
        return
    check_disjoint_gpus(
        parse_gpu_ids(trainer, TRAINER_GPUS_ENV),
        parse_gpu_ids(inference, INFERENCE_GPUS_ENV),
        TRAINER_GPUS_ENV,
        INFERENCE_GPUS_ENV,
    )
