"""`fleetrl plot RUN [RUN ...] [--out FILE]`: a PNG of a run's per-step metrics against step, one subplot per metric
(each on its own y axis, so none is flattened by another's scale), read from `RUN/metrics.jsonl`. Several runs are
compared: one line per run in every subplot, with a legend. Default output: `RUN/curves.png` for one run,
`curves.png` here for several.

    fleetrl plot runs/arithmetic
    fleetrl plot runs/a runs/b --out compare.png --smooth 10
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetrl import metric_names as mn
from fleetrl.metrics_jsonl import one_per_step, read_lines

# The training curves drawn by default, in this order, when a run has them (metric names: fleetrl.metric_names).
CURVES = (
    mn.RAW_REWARD,
    mn.FILTERED_REWARD,
    mn.LOSS,
    mn.KL_REFERENCE,
    mn.KL_SAMPLE_TRAIN,
    mn.ENTROPY,
    mn.GRAD_NORM,
    mn.OFFSET_MEAN,
    mn.OFFSET_MAX,
    mn.RESPONSE_LENGTH_MEAN,
    mn.SAMPLES_PER_S,
)
EVAL_PREFIX = "eval/"
NOT_PLOTTED = {"eval/seconds"}


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


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` in the lines that have it as a finite number."""
    pairs = [(m[mn.STEP], m[key]) for m in rows if _finite(m.get(key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metrics_to_plot(runs: dict[str, tuple[list[dict], list[dict]]], wanted: Sequence[str] | None = None) -> list[str]:
    """The metrics some run has: `wanted` in its order, else CURVES then every evaluation metric (sorted)."""

    def present(key: str) -> bool:
        rows_of = 1 if key.startswith(EVAL_PREFIX) else 0
        return any(series(run[rows_of], key)[0] for run in runs.values())

    if wanted:
        return [k for k in wanted if present(k)]
    evals = sorted({k for _, ev in runs.values() for m in ev for k in m if k.startswith(EVAL_PREFIX)} - NOT_PLOTTED)
    return [k for k in (*CURVES, *evals) if present(k)]


def figure(log_paths: Sequence[Path], metrics: Sequence[str] | None = None, smooth: int = 0) -> Any:
    """The matplotlib Figure (Agg): one subplot per metric, one line per run (labelled with the run's folder name),
    x = step. `smooth` > 1 draws the rolling mean over that many steps instead of the raw values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, tuple[list[dict], list[dict]]] = {}
    for path in log_paths:
        steps, evals = read_metrics(path / "metrics.jsonl")
        if not steps and not evals:
            raise ValueError(f"{path / 'metrics.jsonl'} has no training steps yet")
        runs[_label(path, runs)] = (steps, evals)
    keys = metrics_to_plot(runs, metrics)
    if not keys:
        raise ValueError(f"no metric to plot in {', '.join(map(str, log_paths))} (asked for: {metrics or 'defaults'})")
    cols = 1 if len(keys) == 1 else 2
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.6 * rows), sharex=True, squeeze=False)
    flat = axes.flatten()
    for ax, key in zip(flat, keys, strict=False):
        is_eval = key.startswith(EVAL_PREFIX)
        for label, (steps, evals) in runs.items():
            x, y = series(evals if is_eval else steps, key)
            if not x:
                continue
            if smooth > 1 and not is_eval:
                y = rolling_mean(y, smooth)
            ax.plot(x, y, marker="o" if is_eval else None, markersize=3, label=label)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(loc="best", fontsize=7)
    for ax in flat[len(keys) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle("fleetrl: " + " vs ".join(runs))
    fig.tight_layout()
    return fig


def _label(path: Path, taken: dict[str, Any]) -> str:
    label = path.resolve().name or str(path)
    return str(path) if label in taken else label


def plot(log_paths: Sequence[Path], out: Path, metrics: Sequence[str] | None = None, smooth: int = 0) -> Path:
    """Write the figure of `log_paths` (see `figure`) to `out` as a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(log_paths, metrics, smooth)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("log_paths", type=Path, nargs="+", metavar="RUN", help="a run's log_path (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN/curves.png; curves.png for several runs)")
    parser.add_argument(
        "--metrics",
        nargs="+",
        metavar="KEY",
        help=f"keys to draw (default: {', '.join(CURVES[:3])}, ...)",
    )
    parser.add_argument("--smooth", type=int, default=0, metavar="N", help="draw the rolling mean over N steps")
    args = parser.parse_args(argv)
    default_out = args.log_paths[0] / "curves.png" if len(args.log_paths) == 1 else Path("curves.png")
    try:
        out = plot(args.log_paths, args.out or default_out, args.metrics, args.smooth)
    except (OSError, ValueError) as exc:
        print(f"fleetrl plot: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
