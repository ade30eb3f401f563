"""A spawned test rank that raises fails the spawning test with its own traceback (rank_env.end_rank, called from
the ranks' `finally`, used to end the process with status 0 even while an exception propagated, so
`torch.multiprocessing.spawn` saw a clean exit and the test failed later, on a missing results file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.integration.trainer.rank_env import end_rank

pytestmark = [pytest.mark.integration]


def _failing_worker(rank: int, out: str) -> None:
    try:
        if rank == 1:
            raise RuntimeError("rank 1 failed on purpose: bucket 7 of version 3")
        Path(out, f"rank{rank}.json").write_text(json.dumps({"done": True}))
    finally:
        end_rank()


def test_a_rank_that_raises_fails_the_spawn_with_its_traceback(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="bucket 7 of version 3") as raised:
        mp.spawn(_failing_worker, args=(str(tmp_path),), nprocs=2, join=True)
    assert "_failing_worker" in str(raised.value)  # the rank's traceback, not only the message


def _finishing_worker(rank: int, out: str) -> None:
    try:
        Path(out, f"rank{rank}.json").write_text(json.dumps({"done": True}))
    finally:
        end_rank()


def test_ranks_that_finish_still_end_cleanly(tmp_path):
    mp.spawn(_finishing_worker, args=(str(tmp_path),), nprocs=2, join=True)
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text()) == {"done": True} for r in range(2))
