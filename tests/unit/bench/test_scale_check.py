"""bench/scale_check.py's pure parts: the FLOP count with the attention term and MFU, how many 8B-wide layers fit,
the budget's bound, KERNEL_MIN_SAMPLES from timings, activation bytes without the weights, the table and its files.
The items themselves run in the dry-run test (tests/integration/bench/test_scale_check.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sc = _load("scale_check")

# hidden 4, 2 layers, 2 query heads and 1 kv head of dim 2, MLP 8, vocab 10
SMALL = sc.Shape(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)


def test_attended_keys_is_the_causal_mean_within_each_sample():
    assert sc.attended_keys([4]) == 2.5  # (1 + 2 + 3 + 4) / 4
    assert sc.attended_keys([1, 3]) == 1.75  # (1 + (1 + 2 + 3)) / 4: packed samples do not see each other
    assert sc.attended_keys([]) == 0.0


def test_train_flops_per_token_counts_the_weights_and_the_attention_term():
    # Layer weights: q, k, v, o = 4 x 2 x (2 + 2 + 1 + 1) = 48, MLP 3 x 4 x 8 = 96: 144 a layer.
    assert SMALL.layer_params() == 144
    # 6 x (2 layers x 144 + head 10 x 4) = 1968; attention 12 x 2 layers x 2 heads x dim 2 x 2 keys (n = 3) = 192.
    assert sc.train_flops_per_token(SMALL, 2, [3]) == 1968 + 192
    # One layer fewer drops a layer's weights and its attention.
    assert sc.train_flops_per_token(SMALL, 1, [3]) == 6 * (144 + 40) + 96


def test_the_8b_shape_is_qwen3_8b():
    shape = sc.QWEN3_8B
    params = shape.layers * shape.layer_params() + 2 * shape.vocab * shape.hidden  # untied embedding and head
    assert 8.1e9 < params < 8.3e9  # Qwen3-8B: 8.19B (norms left out)
    # At 2k-token samples the attention term is about 4 % of the FLOPs; at 8k about 13 %.
    base = sc.train_flops_per_token(shape, 36, [1])
    assert 0.03 < 1 - base / sc.train_flops_per_token(shape, 36, [2048]) < 0.05
    assert 0.12 < 1 - base / sc.train_flops_per_token(shape, 36, [8192]) < 0.15


def test_mfu():
    assert sc.mfu(1000.0, 2e9, 4e12) == 0.5
    assert sc.mfu(1000.0, 2e9, None) is None


def test_layers_that_fit_leave_room_for_activations():
    # H200 (150e9 bytes): 0.6 x 150e9 - 16 x 2 x 151936 x 4096 (embedding and head) = 70.1e9 over 16 x 192.9M a layer.
    assert sc.layers_that_fit(sc.QWEN3_8B, 150_000_000_000) == 22
    assert sc.layers_that_fit(sc.QWEN3_8B, 10**9) == 1  # never none
    assert sc.layers_that_fit(sc.QWEN3_8B, 10**15) == 36  # never more than the model has


def test_the_gpu_budget_is_at_most_480_s():
    assert sc.check_budget(480, dry=False) == 480
    assert sc.check_budget(900, dry=True) == 900
    with pytest.raises(ValueError, match="--budget-s 481 is over the GPU run's 480 s"):
        sc.check_budget(481, dry=False)
    with pytest.raises(ValueError, match="--budget-s must be positive"):
        sc.check_budget(0, dry=True)
    assert sum(sc.GPU.limits_s.values()) <= sc.MAX_GPU_BUDGET_S
    assert set(sc.GPU.limits_s) == set(sc.DRY.limits_s) == {n for n, _, _ in sc.ITEMS}


def test_a_budget_over_480_s_fails_at_start_naming_the_flag(tmp_path, capsys):
    assert sc.main(["--out", str(tmp_path), "--budget-s", "600"]) == 2
    assert "--budget-s 600 is over the GPU run's 480 s" in capsys.readouterr().err
    assert not (tmp_path / "scale_check.json").exists()


def test_the_items_in_the_issues_order():
    assert [n for n, _, _ in sc.ITEMS] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_kernel_min_samples_from_timings():
    # samples -> (kernel s, loop s): the kernel wins from 4 samples on.
    assert sc.kernel_min_samples({2: (3.0, 2.0), 4: (2.0, 2.0), 8: (1.0, 2.0), 16: (1.0, 3.0)}) == 4
    # A win below a loss does not count: the kernel must win at every larger count.
    assert sc.kernel_min_samples({2: (1.0, 2.0), 4: (3.0, 2.0), 8: (1.0, 2.0), 16: (1.0, 2.0)}) == 8
    assert sc.kernel_min_samples({2: (1.0, 2.0), 16: (3.0, 2.0)}) is None


def test_saved_bytes_counts_activations_once_and_leaves_the_weights_out():
    layer = torch.nn.Linear(4, 4, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    with sc.saved_bytes(layer) as counted:
        y = (x * x).sum()  # saves x twice: one storage
        z = layer(x).sum()  # saves x again and the weight (a parameter: left out)
    assert counted[0] == 3 * 4 * 4
    (y + z).backward()


def test_the_table_and_the_files_after_every_item(tmp_path):
    ctx = sc.Ctx(
        dry=True,
        device="cpu",
        sizes=sc.DRY,
        workdir=tmp_path / "work",
        out=tmp_path / "out",
        report=sc.Report("test"),
        deadline=time.monotonic() + 60,
    )
    seen = []

    def first(ctx):
        ctx.row("a | b", "1,000 tok/s", seconds=1.23456, tokens_per_s=1000.0)

    def second(ctx):
        seen.append(json.loads((tmp_path / "out" / "scale_check.json").read_text()))  # written after item 1
        raise sc.CheckFailed("the push hung")

    def third(ctx):
        ctx.row("c", "2 GB/s")

    items = ((1, "one", first), (2, "two", second), (3, "three", third))
    assert not sc.gc.run_checks(ctx, items, None, keep_going=True)
    assert [c["check"] for c in seen[0]["checks"]] == [1]
    report = json.loads((tmp_path / "out" / "scale_check.json").read_text())
    assert [(c["check"], c["status"]) for c in report["checks"]] == [(1, "ok"), (2, "FAIL"), (3, "ok")]
    assert report["checks"][1]["error"] == "the push hung"
    lines = ctx.report.table().splitlines()
    assert lines[0] == "| check | item | result | status | s |"
    assert lines[2].startswith("| **1** | **one** |")
    assert lines[3] == "| 1 | a / b | 1,000 tok/s | ok | 1.2 |"
    assert "| **2** | **two** | the push hung | FAIL |" in lines[4]
    assert (tmp_path / "out" / "scale_check.md").read_text().count("\n| **") == 3
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_the_scale_command_fits_one_run_and_carries_liger():
    prepare = _load("gpu_check_prepare")
    command = prepare.scale_command()
    assert len(command) <= 2000
    assert "bench/scale_check.py --out $OUT --keep-going --budget-s 450 " in command
    assert prepare.SCALE_BUDGET_S <= sc.MAX_GPU_BUDGET_S
    # Liger at the version the project's extra pins, and only with --scale.
    assert "liger-kernel==0.8.5" in prepare.pinned(scale=True)
    assert not any(p.startswith("liger-kernel") for p in prepare.pinned())
    with pytest.raises(SystemExit, match=r"no extra in pyproject\.toml pins no-such-wheel"):
        prepare.extra_pin("no-such-wheel")
