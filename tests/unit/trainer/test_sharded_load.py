"""The pure parts of sharded loading: which rows a rank reads, and building on meta with real buffers."""

from __future__ import annotations

import pytest
import torch

from fleetrl.trainer.sharded_load import chunk_range, parameters_on_meta


@pytest.mark.parametrize(("length", "chunks"), [(8, 2), (7, 2), (5, 4), (2, 4), (151_936, 3)])
def test_chunk_ranges_are_torch_chunks(length, chunks):
    rows = torch.arange(length)
    parts = list(torch.chunk(rows, chunks)) + [rows[:0]] * chunks  # torch.chunk may give fewer than `chunks`
    for index in range(chunks):
        start, stop = chunk_range(length, chunks, index)
        assert torch.equal(rows[start:stop], parts[index]), (length, chunks, index)


def test_modules_built_on_meta_keep_real_buffers_and_ties():
    with parameters_on_meta():
        embed = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = embed.weight
        holder = torch.nn.Module()
        holder.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)), persistent=False)
    assert embed.weight.device.type == "meta" and head.weight is embed.weight
    assert holder.inv_freq.device.type == "cpu" and holder.inv_freq[0] == 1.0
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block
