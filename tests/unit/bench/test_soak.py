"""bench/soak.py's pure parts: which processes are the run's services, and how a flat or a climbing RSS reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_soak", REPO / "bench" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules["bench_soak"] = soak
_spec.loader.exec_module(soak)


def probes(service: str, rss_at) -> list:
    return [soak.Probe(t, t // 10, service, 1, rss_at(t), 20, 10) for t in range(0, 1000, 10)]


def test_a_flat_service_reads_flat_and_a_climbing_one_reads_its_climb():
    summary = soak.summarise(probes("flat", lambda t: 100.0) + probes("leaky", lambda t: 100.0 + t / 10), 1000.0)
    assert summary["flat"]["rss_mb_per_hour"] == 0.0
    assert summary["flat"]["rss_mb_early"] == summary["flat"]["rss_mb_late"] == 100.0
    # 0.1 MB a second is 360 MB an hour; the early stretch is the second fifth (probes at 200-390 s), the late the
    # last (800-990 s)
    assert abs(summary["leaky"]["rss_mb_per_hour"] - 360.0) < 1e-6
    assert summary["leaky"]["rss_mb_early"] == 129.5 and summary["leaky"]["rss_mb_late"] == 189.5  # t = 295, 895 s


def test_only_the_runs_own_services_are_found_and_named(monkeypatch, tmp_path):
    run = tmp_path / "run"
    other = tmp_path / "other"
    ps = "\n".join(
        [
            f"11 python -m fleetrl serve controller --config c --ready-file {run}/ready/controller.json",
            f"12 python -m fleetrl serve inference --model m --ready-file {run}/ready/inference-0-r1.json",
            f"14 python -m fleetrl serve gateway --config c --controller-ready-file {run}/ready/controller.json",
            f"13 python -m fleetrl serve gateway --config c --controller-ready-file {run}/ready/controller.json",
            f"15 python -m fleetrl serve trainer --config c --ready-file {other}/ready/trainer.json",
            "16 python -m pytest tests",
        ]
    )

    class Done:
        stdout = ps + "\n"

    monkeypatch.setattr(soak.subprocess, "run", lambda *a, **k: Done())
    assert soak.service_processes(run) == {"controller": 11, "inference-0-r1": 12, "gateway-0": 13, "gateway-1": 14}
