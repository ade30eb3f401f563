"""The datums a step trains on are `fleetrl.trainer.datum.build_datum`'s, on one process and on every rank of a
distributed step (where each rank receives only the rows it trains, as flat tensors): the one-token shift, the
logprobs and the per-token policy versions arrive unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from fleetrl import RolloutSample
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer import distributed as fdist
from fleetrl.trainer.datum import build_datum
from tests.unit.trainer.helpers import make_cfg

SAMPLES = [
    RolloutSample([5, 6, 7, 8], [0.0, -0.25, -0.5, -0.125], [0, 1, 1, 1], 1.0, versions=[0, 3, 3, 4]),
    RolloutSample([9, 10, 11], [0.0, 0.0, -0.75], [0, 0, 1], 0.0),  # versions unknown
    RolloutSample([12, 13], [0.0, -1.5], [0, 1], 0.5, versions=[2, 5]),
]


@pytest.fixture
def trainer(tiny_model_dir, tmp_path):
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path))
    yield trainer
    trainer.close()


def _header() -> dict:
    return {
        "lengths": [len(s.tokens) for s in SAMPLES],
        "versioned": [s.versions is not None for s in SAMPLES],
        "has_ref": False,
    }


def test_a_single_process_step_trains_build_datum_of_each_sample(trainer):
    batch = SimpleNamespace(samples=SAMPLES, advantages=[1.0, -1.0, 0.0])
    datums, advantages = trainer._step_tensors(_header(), batch)
    assert datums == [build_datum(s) for s in SAMPLES]
    assert advantages.tolist() == [1.0, -1.0, 0.0]


def _fake_scatter(monkeypatch) -> list:
    """`fdist.scatter_tensors` without a process group: rank 0's call keeps each rank's part; a follower's returns its
    own (checked against the specs it derived from the header alone)."""
    sent: list = []

    def scatter(parts, specs, ctx):
        if ctx.is_main:
            sent[:] = [{k: v.clone() for k, v in part.items()} for part in parts]
        mine = sent[ctx.rank]
        assert {k: (dt, n) for k, (dt, n) in specs.items()} == {k: (v.dtype, len(v)) for k, v in mine.items()}
        return {k: v.clone() for k, v in mine.items()}

    monkeypatch.setattr(fdist, "scatter_tensors", scatter)
    return sent


def test_each_rank_of_a_distributed_step_gets_the_datums_of_its_rows_versions_included(trainer, monkeypatch):
    sent = _fake_scatter(monkeypatch)
    batch = SimpleNamespace(samples=SAMPLES, advantages=[1.0, -1.0, 0.0])
    expected = [build_datum(s) for s in SAMPLES]
    assert expected[0].versions == [3, 3, 4] and expected[1].versions is None and expected[2].versions == [5]
    # 3 rows of 3, 2 and 1 tokens over 2 ranks, balanced by tokens: rank 0 trains row 0, rank 1 rows 1 and 2.
    assert trainer.cfg.num_minibatches == 1

    trainer.ctx = dataclasses.replace(trainer.ctx, rank=0, world_size=2)
    main, main_adv = trainer._step_tensors(_header(), batch)
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=1, world_size=2)
    follower, follower_adv = trainer._step_tensors(_header(), None)
    assert main == {0: expected[0]}
    assert follower == {1: expected[1], 2: expected[2]}
    assert main_adv[[0]].tolist() == [1.0] and follower_adv[[1, 2]].tolist() == [-1.0, 0.0]
    # What crossed to rank 1 is its rows alone: 3 + 2 tokens, their advantages, the versions of the versioned one.
    assert {k: len(v) for k, v in sent[1].items()} == {
        "tokens": 5,
        "logprobs": 5,
        "mask": 5,
        "advantages": 2,
        "versions": 2,
    }


def test_the_reference_logprobs_of_a_rank_are_those_of_its_rows(trainer, monkeypatch):
    from concurrent.futures import Future

    sent = _fake_scatter(monkeypatch)
    ref = [[-0.5, -1.0, -1.5], [-2.0, -2.5], [-3.0]]
    future: Future = Future()
    header = {**_header(), "has_ref": True}
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=0, world_size=2)
    main_pending = trainer._pending_ref(header, future)
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=1, world_size=2)
    follower_pending = trainer._pending_ref(header, None)
    assert not sent  # nothing travels before the inner loop asks: the reference still computes
    future.set_result(ref)
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=0, world_size=2)
    main_ref = main_pending.get()
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=1, world_size=2)
    follower_ref = follower_pending.get()
    assert {i: t.tolist() for i, t in main_ref.items()} == {0: ref[0]}
    assert {i: t.tolist() for i, t in follower_ref.items()} == {1: ref[1], 2: ref[2]}
    assert main_pending.get() is main_ref  # one wait, one scatter
