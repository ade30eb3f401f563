"""The datums a step trains on are `fleetrl.datum.build_datum`'s, on one process and on every rank of a
distributed step (whose samples cross ranks as flat tensors): the one-token shift, the logprobs and the per-token
policy versions arrive unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fleetrl import RolloutSample
from fleetrl.datum import build_datum
from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer import distributed as fdist
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
    datums, advantages, _ = trainer._step_tensors(_header(), batch, None)
    assert datums == [build_datum(s) for s in SAMPLES]
    assert advantages.tolist() == [1.0, -1.0, 0.0]


def test_every_rank_of_a_distributed_step_gets_the_same_datums_versions_included(trainer, monkeypatch):
    sent: dict[str, torch.Tensor] = {}

    def broadcast(tensors, specs, ctx):  # rank 0 sends; the others receive what it sent
        if ctx.is_main:
            sent.update({k: v.clone() for k, v in tensors.items()})
        assert {k: (dt, n) for k, (dt, n) in specs.items()} == {k: (v.dtype, len(v)) for k, v in sent.items()}
        return {k: v.clone() for k, v in sent.items()}

    monkeypatch.setattr(fdist, "broadcast_tensors", broadcast)
    batch = SimpleNamespace(samples=SAMPLES, advantages=[1.0, -1.0, 0.0])
    expected = [build_datum(s) for s in SAMPLES]
    assert expected[0].versions == [3, 3, 4] and expected[1].versions is None and expected[2].versions == [5]

    trainer.ctx = dataclasses.replace(trainer.ctx, rank=0, world_size=2)
    main, _, _ = trainer._step_tensors(_header(), batch, None)
    trainer.ctx = dataclasses.replace(trainer.ctx, rank=1, world_size=2)
    follower, advantages, _ = trainer._step_tensors(_header(), None, None)
    assert main == expected
    assert follower == expected
    assert advantages.tolist() == [1.0, -1.0, 0.0]
