"""cpu_thread_binds: each tensor-parallel rank of a vLLM-CPU engine gets its own share of the CPUs."""

from __future__ import annotations

import pytest

from fleetrl.services.inference.vllm_cpu_binds import cpu_thread_binds


@pytest.mark.parametrize(
    ("cpus", "ranks", "binds"),
    [
        ([0, 1], 2, "0|1"),
        ([3, 2, 1, 0], 2, "0,1|2,3"),
        ([0, 1, 2, 3, 4], 2, "0,1,2|3,4"),
        ([4, 6, 9], 1, "4,6,9"),
        ([0, 1, 2], 3, "0|1|2"),
    ],
)
def test_each_rank_gets_a_contiguous_share(cpus, ranks, binds):
    assert cpu_thread_binds(cpus, ranks) == binds


def test_fewer_cpus_than_ranks_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 needs at least 4 CPUs.*may use 2"):
        cpu_thread_binds([0, 1], 4)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        cpu_thread_binds([0, 1], 0)
