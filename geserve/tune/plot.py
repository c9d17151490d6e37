"""The throughput-latency plot (PNG): each configuration's points joined by rising concurrency, the Pareto front,
the budget and the winner marked. Needs matplotlib (`pip install 'geserve[tune]'`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from geserve.tune.report import pareto_front, winner
from geserve.tune.sweep import Point, SweepOptions

MAX_LEGEND_ENTRIES = 12


def write_plot(points: Sequence[Point], options: SweepOptions, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 5), dpi=100)
    _plot_candidates(axes, plt, points)
    _plot_front(axes, points)
    axes.axvline(options.budget_ms, color="red", linestyle="--", linewidth=1,
                 label=f"budget p{options.percentile} {options.budget_ms:g} ms")
    best = winner(points)
    if best is not None:
        axes.plot([best.latency_ms], [best.throughput], "*", color="gold", markeredgecolor="black", markersize=18,
                  label=f"winner: {best.candidate.label} c={best.concurrency}", zorder=5)
    _format_axes(axes, options)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _plot_candidates(axes: Any, plt: Any, points: Sequence[Point]) -> None:
    candidates = list(dict.fromkeys(p.candidate for p in points if p.measurement))
    colors = plt.get_cmap("tab10" if len(candidates) <= 10 else "tab20")
    for index, candidate in enumerate(candidates):
        mine = [p for p in points if p.candidate == candidate and p.measurement]
        _plot_candidate(axes, mine, colors(index), candidate.label if index < MAX_LEGEND_ENTRIES else None)


def _plot_candidate(axes: Any, mine: list[Point], color: Any, label: str | None) -> None:
    """One configuration's measured points, joined by rising concurrency and each labelled with it."""
    axes.plot([p.latency_ms for p in mine], [p.throughput for p in mine], "o-", color=color,
              markersize=4, linewidth=1, alpha=0.75, label=label)
    for point in mine:
        axes.annotate(f"c{point.concurrency}", (point.latency_ms, point.throughput), fontsize=6,
                      xytext=(3, 3), textcoords="offset points", color=color)


def _plot_front(axes: Any, points: Sequence[Point]) -> None:
    front = pareto_front(points)
    axes.step([p.latency_ms for p in front], [p.throughput for p in front], where="post", color="black",
              linewidth=2, label="Pareto front")
    axes.plot([p.latency_ms for p in front], [p.throughput for p in front], "D", color="black", markersize=6,
              fillstyle="none")


def _format_axes(axes: Any, options: SweepOptions) -> None:
    from matplotlib.ticker import FuncFormatter

    axes.set_xscale("log")  # latency grows by factors with concurrency; plain numbers on the ticks, not powers
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if str(value)[0] in "25" else ""))
    axes.set_xlabel(f"p{options.percentile} latency (ms, log scale)")
    axes.set_ylabel("throughput (infer/s)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"geserve tune: {options.model}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside, not over
