"""`fleetrl plot LOG_PATH [--out FILE]`: a PNG of reward, held-out accuracy, KL, entropy and version offset per step,
read from `LOG_PATH/metrics.jsonl` (default output `LOG_PATH/curves.png`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fleetrl.metrics_jsonl import one_per_step, read_lines


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training step lines, evaluation lines) of a metrics.jsonl, one per step: where a resumed run retrained a
    step, its last line wins (fleetrl.metrics_jsonl)."""
    return one_per_step(read_lines(path))


def rolling_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(log_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_metrics(log_path / "metrics.jsonl")
    if not steps:
        raise ValueError(f"{log_path / 'metrics.jsonl'} has no training steps yet")
    x = [m["step"] for m in steps]

    def series(key: str, rows: list[dict[str, Any]] = steps) -> tuple[list[float], list[float]]:
        pairs = [(m["step"], m[key]) for m in rows if key in m]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    fig, axes = plt.subplots(5, 1, figsize=(8, 13), sharex=True)
    reward = [m.get("reward/mean", float("nan")) for m in steps]
    axes[0].plot(x, reward, alpha=0.35, label="reward/mean")
    axes[0].plot(x, rolling_mean(reward, 10), label="rolling mean (10)")
    axes[0].set_ylabel("reward")
    for key in ("eval/accuracy", "eval/sampled_accuracy"):
        ex, ey = series(key, evals)
        if ex:
            axes[1].plot(ex, ey, marker="o", label=key)
    axes[1].set_ylabel("held-out")
    for key in ("kl_sample_train_v1", "ppo_kl", "ref_kl"):
        kx, ky = series(key)
        if kx:
            axes[2].plot(kx, ky, label=key)
    axes[2].set_ylabel("KL")
    ex, ey = series("entropy")
    axes[3].plot(ex, ey, label="entropy")
    axes[3].set_ylabel("entropy")
    for key in ("async/version_offset_mean", "async/version_offset_max"):
        ox, oy = series(key)
        axes[4].plot(ox, oy, label=key)
    axes[4].set_ylabel("version offset")
    axes[4].set_xlabel("step")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"fleetrl: {log_path}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl plot", description=__doc__.split("\n")[0])
    parser.add_argument("log_path", type=Path, help="the run's log_path (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG to write (default LOG_PATH/curves.png)")
    args = parser.parse_args(argv)
    try:
        out = plot(args.log_path, args.out or args.log_path / "curves.png")
    except (OSError, ValueError) as exc:
        print(f"fleetrl plot: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
