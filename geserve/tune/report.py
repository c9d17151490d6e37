"""What a sweep found: the winner (highest throughput within the latency budget), the Pareto front, and the
Markdown report of every point."""

from __future__ import annotations

from collections.abc import Sequence

from geserve.tune.sweep import MEASURED, Point, SweepOptions


def winner(points: Sequence[Point]) -> Point | None:
    """The point with the highest throughput whose latency stayed within the budget."""
    within = [p for p in points if p.status == MEASURED and p.measurement]
    return max(within, key=lambda p: p.throughput, default=None)


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """Measured points no other point beats on both throughput and latency, by rising latency."""
    measured = sorted((p for p in points if p.measurement), key=lambda p: (p.latency_ms, -p.throughput))
    front: list[Point] = []
    for point in measured:
        if not front or point.throughput > front[-1].throughput:
            front.append(point)
    return front


def _cell(value: float, digits: int) -> str:
    return "" if value != value else f"{value:.{digits}f}"  # NaN: not measured


def markdown(points: Sequence[Point], options: SweepOptions, *, command: str, config_text: str | None,
             plot_name: str | None, elapsed_s: float) -> str:
    best, front = winner(points), set(pareto_front(points))
    q = f"p{options.percentile}"
    lines = [f"# geserve tune: {options.model}", ""]
    lines += _summary(points, options, command, elapsed_s, q)
    lines += _busy_warning(points, options)
    lines += _winner_section(best, q, config_text)
    if plot_name:
        lines += [f"![throughput against {q} latency]({plot_name})", ""]
    lines += _points_table(points, best, front, q)
    return "\n".join(lines) + "\n"


def _measured_count(points: Sequence[Point]) -> int:
    return sum(p.measurement is not None for p in points)


def _summary(points: Sequence[Point], options: SweepOptions, command: str, elapsed_s: float, q: str) -> list[str]:
    """How the sweep was run: the command, the budget and the load, how many points, how long."""
    return [
        f"- command: `{command}`",
        f"- latency budget: {q} ≤ {options.budget_ms:g} ms; concurrency {', '.join(map(str, options.concurrencies))} "
        f"over {options.protocol}; perf_analyzer windows of {options.window_ms} ms",
        f"- {len({p.candidate for p in points})} configurations, {_measured_count(points)} "
        f"points measured in {elapsed_s:.0f} s; a point is measured again (up to {options.max_repeats} times) when "
        f"other processes used more than {options.busy_limit:.0%} of the CPUs during it",
        "",
    ]


def _busy_warning(points: Sequence[Point], options: SweepOptions) -> list[str]:
    """A warning when points were measured on a busy machine (none otherwise): their latencies are not to be trusted."""
    busy = [p for p in points if p.measurement and p.others is not None and p.others > options.busy_limit]
    if not busy:
        return []
    return [f"**{len(busy)} of {_measured_count(points)} points were measured while other "
            "processes used more of the CPUs than the limit, even after their repeats: their latencies are "
            "inflated (and may have stopped a configuration early). Run again on a quiet machine to trust "
            "them.**", ""]


def _winner_section(best: Point | None, q: str, config_text: str | None) -> list[str]:
    """The winner and the config written for it, or why there is none."""
    if best is None or best.measurement is None:
        return ["**No point stayed within the budget**: no config.pbtxt was written.", ""]
    lines = [
        "## Winner",
        "",
        f"**{best.candidate.label}** at concurrency {best.concurrency}: {best.throughput:.0f} infer/s, "
        f"{q} {best.latency_ms:.2f} ms (p50 {best.measurement.p50_us / 1000:.2f} ms).",
        "",
    ]
    if config_text is not None:
        lines += ["```", config_text.rstrip(), "```", ""]
    return lines


def _points_table(points: Sequence[Point], best: Point | None, front: set[Point], q: str) -> list[str]:
    """Every point, one row each, in the order measured."""
    lines = [
        "## Every point",
        "",
        "★ winner, ◆ on the Pareto front (no other point has both more throughput and less latency).",
        "",
        "| | instances | max_batch_size | queue delay µs | gears | precision | concurrency | infer/s | p50 ms "
        f"| {q} ms | others' CPU | repeats | status |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for point in points:
        mark = "★" if point is best else ("◆" if point in front else "")
        lines.append(" | ".join([f"| {mark}", *_candidate_cells(point), *_measured_cells(point)]))
    return lines


def _candidate_cells(point: Point) -> list[str]:
    """What was tried: the configuration and the load."""
    c = point.candidate
    return [
        str(c.instances), str(c.max_batch_size), "—" if c.queue_delay_us is None else str(c.queue_delay_us),
        ",".join(map(str, c.gears)) or "—", c.precision or "—", str(point.concurrency),
    ]


def _measured_cells(point: Point) -> list[str]:
    """What was measured (empty cells for what was not), and how it ended."""
    m = point.measurement
    status = point.status + (f": {point.note}" if point.note else "")
    return [
        f"{m.throughput:.0f}" if m else "", _cell(m.p50_us / 1000 if m else float("nan"), 2),
        _cell(point.latency_ms, 2), "" if point.others is None else f"{point.others:.0%}",
        str(point.repeats), status + " |",
    ]
