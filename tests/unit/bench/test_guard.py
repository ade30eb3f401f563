"""bench/guard.py: its record in docs/benchmarks.md is read back as written, a figure worse than the recorded
spread is flagged (and only then), and a dry run at tiny sizes runs every arm end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_guard", REPO / "bench" / "guard.py")
guard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = guard
_spec.loader.exec_module(guard)


def results(scale: float) -> dict[str, list[float]]:
    return {name: [scale * (i + 1), scale * (i + 1.1)] for i, name in enumerate(guard.FIGURES)}


def doc(tmp_path: Path) -> Path:
    path = tmp_path / "benchmarks.md"
    path.write_text(f"# Benchmarks\n\n{guard.SECTION}\n\nWhat the guard measures.\n\n## Next section\n\ntext\n")
    return path


def test_the_docs_hold_a_record_of_every_figure():
    record = guard.recorded()
    assert set(record) == set(guard.FIGURES)
    assert all(low <= median <= high for median, low, high in record.values())


def test_a_recorded_table_reads_back_newest_first(tmp_path):
    path = doc(tmp_path)
    assert guard.recorded(path) == {}
    guard.record_table(results(1.0), "first", path)
    guard.record_table(results(2.0), "second", path)
    text = path.read_text()
    assert text.index("### second") < text.index("### first") < text.index("## Next section")
    record = guard.recorded(path)
    assert set(record) == set(guard.FIGURES)
    # the newest table's median, the min and max over the two newest tables
    assert record["trainer_step"] == (2.1, 1.0, 2.2)
    guard.record_table(results(3.0), "third", path)
    assert guard.recorded(path)["trainer_step"] == (3.15, 2.0, 3.3)  # the oldest no longer counts
    assert "text" in text and text.startswith("# Benchmarks")


def test_only_a_figure_worse_by_more_than_the_recorded_spread_is_flagged():
    record = (1.0, 0.9, 1.2)  # spread 0.3
    assert not guard.worse(1.29, record)
    assert guard.worse(1.31, record)
    assert not guard.worse(0.5, record)  # better is never flagged
    assert guard.worse(1.06, (1.0, 1.0, 1.0)) and not guard.worse(1.04, (1.0, 1.0, 1.0))  # a 5 % floor
    now = {name: [1.0, 1.0] for name in guard.FIGURES}
    record = {name: (1.0, 1.0, 1.0) for name in guard.FIGURES}
    now["up_o1_step"] = [1.5, 1.5]
    text, flagged = guard.table(now, record)
    assert flagged == ["up_o1_step"] and text.count("WORSE") == 1


def test_the_ratios_are_each_figure_over_its_own_baseline():
    run = {
        "limit_t1": {"step_s": 0.5, "first_step_s": 10.0, "train_s": 0.2},
        "fleetrl_sync": {"step_s": 1.0, "first_step_s": 15.0, "train_s": 0.3},
        "fleetrl_o1": {"step_s": 0.4, "first_step_s": 14.0, "train_s": 0.25},
        "version": {"bytes": 1.0, "serves_s": 3.0, "raw_zmq_s": 0.5},
    }
    assert guard.ratios(run) == pytest.approx(
        {"trainer_step": 1.5, "up_sync_step": 2.0, "up_o1_step": 0.8, "up_first_step": 1.4, "version_to_replica": 6.0}
    )


@pytest.mark.slow
@pytest.mark.integration
def test_a_dry_run_measures_every_figure_and_records_it(tmp_path):
    """Every arm for real at tiny sizes: the bare loop, `fleetrl up` sync and O = 1, a version to an hf replica and
    raw ZeroMQ; the table is recorded into a copy of the docs. (~2 min on 2 cores.)"""
    path = doc(tmp_path)
    cmd = [sys.executable, str(REPO / "bench" / "guard.py"), "--tiny", "--repeats", "1", "--steps", "3"]
    cmd += ["--warm-steps", "5", "--cache", str(tmp_path / "cache"), "--doc", str(path), "--record"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = guard.recorded(path)
    assert set(record) == set(guard.FIGURES)
    assert all(median > 0 for median, _, _ in record.values())
    for name in guard.FIGURES:
        assert f"`{name}`" in done.stdout
