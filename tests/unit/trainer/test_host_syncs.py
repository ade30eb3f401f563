"""The inner loop keeps a minibatch's loss metrics on the device and reads them once (item 2 of issue 40): on CUDA
every scalar read is a host sync that stalls the queue, so several per micro-batch cost the GPU its lead. On CPU
the reads are counted as the ops that make them (`aten._local_scalar_dense`: `float(t)`, `t.item()`); the one read
at the end is a `tolist()`, which does not dispatch that op."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fleetrl.trainer import PolicyTrainer
from fleetrl.trainer.minibatches import SampleFigures, Totals, part_loss_scale, part_loss_scale_of_counts
from tests.unit.trainer.helpers import make_cfg
from tests.unit.trainer.test_packing import _datums


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_a_minibatch_of_several_packed_micro_batches_reads_no_scalar_from_the_device(tiny_model_dir, tmp_path):
    """Packed rows (the default). Padded rows make transformers read one scalar per forward itself (its check for
    packed sequences in the position ids, masking_utils), which fleetrl does not control."""
    trainer = PolicyTrainer(make_cfg(tiny_model_dir, tmp_path, micro_batch_tokens=20))
    datums = _datums(3)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5])
    assert len(trainer.loop._my_micro_batches(range(5), SampleFigures.of(datums))) >= 3
    with _ScalarReads() as probe:
        sums = trainer.loop.accumulate_gradients(datums, advantages, list(range(len(datums))))
    assert probe.reads == 0  # before: 4 to 5 per micro-batch (loss scale, tokens, loss, metrics, entropy, mask check)
    assert sums["_tokens"] == sum(sum(d.weights) for d in datums)
    assert all(isinstance(v, float) for v in sums.values())
    trainer.close()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "sum"])
def test_the_loss_scale_from_host_counts_is_the_scale_from_the_mask(mode):
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    totals = Totals(tokens=12.0, sequences=5.0)
    counts = [int(c) for c in mask.sum(-1)]
    assert part_loss_scale_of_counts(mode, counts, totals) == part_loss_scale(mode, mask, totals)
