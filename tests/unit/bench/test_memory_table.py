"""bench/memory_table.py: the per-rank memory model reproduces the H100's measured peak it was not calibrated on,
and each 70B option saves what it says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_memory_table", REPO / "bench" / "memory_table.py")
memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = memory
_spec.loader.exec_module(memory)


def test_the_shapes_have_their_published_sizes():
    sizes = {key: shape.params() / 1e9 for key, shape in memory.SHAPES.items()}
    assert sizes["1.5B (H100 check)"] == pytest.approx(1.54, abs=0.01)
    assert sizes["8B"] == pytest.approx(8.2, abs=0.1)
    assert sizes["32B"] == pytest.approx(32.8, abs=0.2)
    assert sizes["70B"] == pytest.approx(70.6, abs=0.2)


def test_the_model_predicts_the_peak_it_was_not_calibrated_on():
    m = memory.calibrate()
    checked = {tokens: (predicted, measured) for tokens, predicted, measured in memory.check(m)}
    predicted, measured = checked[memory.CALIBRATION_TOKENS]
    assert predicted == pytest.approx(measured, rel=1e-9)  # by construction
    predicted, measured = checked[8_190]
    assert predicted == pytest.approx(measured, rel=0.05)


def test_bf16_moments_save_four_bytes_a_parameter_and_offload_moves_the_state_off_the_device():
    shape, world, tokens, m = memory.SHAPES["70B"], 32, 16_384, memory.calibrate()
    default = memory.components(shape, world, tokens, transient_bytes=m)
    bf16 = memory.components(shape, world, tokens, transient_bytes=m, moment_bytes=2)
    offload = memory.components(shape, world, tokens, transient_bytes=m, moment_bytes=2, cpu_offload=True)
    saved = default["optimizer step"] - bf16["optimizer step"]
    assert saved == pytest.approx(4 * shape.params() / world)
    assert offload["weights and moments"] == offload["optimizer step"] == 0.0
    assert memory.peak(offload) < memory.peak(bf16) < memory.peak(default)
    assert "70B" in memory.table(m)
