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


def test_unsharded_parameters_and_stored_buffers_load_whole_in_the_models_dtype(tmp_path):
    from safetensors.torch import save_file

    from fleetrl.trainer.sharded_load import load_shards

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(3, 5)
            self.register_buffer("scale", torch.zeros(5))  # persistent: in the checkpoint

    stored = {"proj.weight": torch.randn(5, 3), "proj.bias": torch.randn(5), "scale": torch.arange(5.0)}
    save_file({k: v.to(torch.bfloat16) for k, v in stored.items()}, tmp_path / "model.safetensors")
    model = Tiny().to(torch.float32)
    load_shards(model, tmp_path)
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, stored[name].to(torch.bfloat16).float(), atol=0, rtol=0, msg=name)


def test_a_parameter_missing_from_the_checkpoint_fails_naming_it(tmp_path):
    from safetensors.torch import save_file

    from fleetrl.trainer.sharded_load import load_shards

    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="has no tensor 'bias'"):
        load_shards(torch.nn.Linear(2, 2), tmp_path)
