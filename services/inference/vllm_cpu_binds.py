"""Which CPUs each tensor-parallel rank of a vLLM-CPU engine runs its threads on.

vLLM's CPU backend binds each rank's OpenMP threads to one NUMA node by default ("auto") and refuses to start when
there are fewer NUMA nodes than ranks ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"),
which is every ordinary one-socket machine. Unless the user set VLLM_CPU_OMP_THREADS_BIND, the VLLMEngine gives
each rank its own contiguous share of the CPUs this process may use instead:

    cpu_thread_binds([0, 1, 2, 3], ranks=2)  ->  "0,1|2,3"   (VLLM_CPU_OMP_THREADS_BIND's syntax)
"""

from __future__ import annotations

from collections.abc import Sequence

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_thread_binds(cpus: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND splitting `cpus` into `ranks` contiguous shares (the first ones one larger when
    it does not divide); ValueError when there are fewer CPUs than ranks."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise ValueError(
            f"tensor_parallel_size {ranks} needs at least {ranks} CPUs on a CPU machine; this process may use "
            f"{len(cpus)} ({cpus})"
        )
    base, extra = divmod(len(cpus), ranks)
    shares, start = [], 0
    for rank in range(ranks):
        size = base + (1 if rank < extra else 0)
        shares.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return "|".join(shares)
