"""Sharded loading (issue 26): two gloo ranks build the model on meta, shard it and each read only its own rows of the
checkpoint, and end with exactly the weights (and logprobs) of a plain whole load; each rank's peak memory while
loading is about half of a whole load's."""

from __future__ import annotations

import json
import socket
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from fleetrl.trainer.distributed import destroy, full_state_dict, shard_model
from fleetrl.trainer.model import load_causal_lm, target_logprobs
from fleetrl.trainer.sharded_load import checkpoint_files, load_sharded_causal_lm
from tests.integration.trainer.rank_env import end_rank, rank_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORLD = 2


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (3, 12), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _load_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    ctx = rank_context(rank, WORLD, port)
    try:
        device = torch.device("cpu")
        model = load_sharded_causal_lm(model_dir, partial(shard_model, device=device, world_size=WORLD))
        assert model.training and model.config.use_cache is False
        state = full_state_dict(model, ctx)
        inputs, targets = _batch(model.config.vocab_size)
        with torch.no_grad():
            logprobs, _ = target_logprobs(model, inputs, targets)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/state.safetensors")
            torch.save(logprobs, f"{out}/logprobs.pt")
    finally:
        destroy(ctx)
    end_rank()


def _tied_sharded_copy(model_dir: str, out: Path) -> str:
    """The tiny model with tied embeddings (no lm_head in the files) and an odd vocabulary, saved as a sharded
    checkpoint with an index."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.resize_token_embeddings(model.config.vocab_size + 3)  # an odd vocabulary: the two ranks' rows differ
    assert model.config.vocab_size % WORLD
    model.save_pretrained(out, max_shard_size="100KB")
    return str(out)


@pytest.mark.parametrize("layout", ["single file", "tied, odd vocabulary, index"])
def test_two_ranks_load_their_shards_to_exactly_the_whole_model(tiny_model_dir, tmp_path, free_port, layout):
    model_dir = tiny_model_dir if layout == "single file" else _tied_sharded_copy(tiny_model_dir, tmp_path / "tied")
    if layout != "single file":
        files = checkpoint_files(model_dir)
        assert "lm_head.weight" not in files and len(set(files.values())) > 1  # the cases under test
    mp.spawn(_load_worker, args=(free_port, model_dir, str(tmp_path)), nprocs=WORLD, join=True)

    from safetensors.torch import load_file

    plain = load_causal_lm(model_dir)
    sharded = load_file(tmp_path / "state.safetensors")
    expected = plain.state_dict()
    assert set(sharded) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(sharded[name], value, atol=0, rtol=0, msg=name)
    inputs, targets = _batch(plain.config.vocab_size)
    with torch.no_grad():
        expected_logprobs, _ = target_logprobs(plain, inputs, targets)
    torch.testing.assert_close(torch.load(tmp_path / "logprobs.pt"), expected_logprobs, atol=1e-6, rtol=0)


# --- memory ------------------------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def warm_up_imports(model_dir: str) -> None:
    """What loading imports (transformers' model classes: ~200 MB of code and tables), by building a one-layer
    copy, so it is in the baseline of both modes and the growth is the weights'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers, config.vocab_size = 1, 256
    AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _memory_worker(rank: int, port: int, model_dir: str, mode: str, out: str) -> None:
    ctx = rank_context(rank, WORLD, port)
    try:
        device = torch.device("cpu")
        shard = partial(shard_model, device=device, world_size=WORLD)
        warm_up_imports(model_dir)  # the model classes' imports are in the baseline of both modes
        # The peak is this process's own (VmHWM, reset here): ru_maxrss would carry the high-water mark of the
        # parent this rank was forked from across exec, which in a long pytest session exceeds both loads.
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_kb()
        if mode == "sharded":
            model = load_sharded_causal_lm(model_dir, shard)
        else:
            model = load_causal_lm(model_dir)
            shard(model)
        peak = _status_kb("VmHWM")
        Path(f"{out}/{mode}-{rank}.json").write_text(json.dumps({"before_kb": before, "peak_kb": peak}))
        del model
    finally:
        destroy(ctx)
    end_rank()


def _write_model(out: Path) -> str:
    """A random Qwen2-shaped model of about 330 MB (bfloat16 on disk, the trainer loads float32: ~660 MB whole)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return str(out)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_each_rank_peaks_at_about_half_of_a_whole_load(tmp_path):
    model_dir = _write_model(tmp_path / "model")
    peaks = {}
    for mode in ("whole", "sharded"):
        mp.spawn(_memory_worker, args=(_free_port(), model_dir, mode, str(tmp_path)), nprocs=WORLD, join=True)
        grown = []
        for rank in range(WORLD):
            figures = json.loads((tmp_path / f"{mode}-{rank}.json").read_text())
            grown.append(figures["peak_kb"] - figures["before_kb"])
        peaks[mode] = max(grown)
    # The whole load holds every weight in float32 on every rank; the sharded one its half plus one slice in flight.
    assert peaks["sharded"] < 0.75 * peaks["whole"], peaks
