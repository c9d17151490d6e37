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
    lines += [
        f"- command: `{command}`",
        f"- latency budget: {q} ≤ {options.budget_ms:g} ms; concurrency {', '.join(map(str, options.concurrencies))} "
        f"over {options.protocol}; perf_analyzer windows of {options.window_ms} ms",
        f"- {len({p.candidate for p in points})} configurations, {sum(p.measurement is not None for p in points)} "
        f"points measured in {elapsed_s:.0f} s; a point is measured again (up to {options.max_repeats} times) when "
        f"other processes used more than {options.busy_limit:.0%} of the CPUs during it",
        "",
    ]
    busy = [p for p in points if p.measurement and p.others is not None and p.others > options.busy_limit]
    if busy:
        lines += [f"**{len(busy)} of {sum(p.measurement is not None for p in points)} points were measured while other "
                  "processes used more of the CPUs than the limit, even after their repeats: their latencies are "
                  "inflated (and may have stopped a configuration early). Run again on a quiet machine to trust "
                  "them.**", ""]
    if best is None or best.measurement is None:
        lines += ["**No point stayed within the budget**: no config.pbtxt was written.", ""]
    else:
        lines += [
            "## Winner",
            "",
            f"**{best.candidate.label}** at concurrency {best.concurrency}: {best.throughput:.0f} infer/s, "
            f"{q} {best.latency_ms:.2f} ms (p50 {best.measurement.p50_us / 1000:.2f} ms).",
            "",
        ]
        if config_text is not None:
            lines += ["```", config_text.rstrip(), "```", ""]
    if plot_name:
        lines += [f"![throughput against {q} latency]({plot_name})", ""]
    lines += [
        "## Every point",
        "",
        "★ winner, ◆ on the Pareto front (no other point has both more throughput and less latency).",
        "",
        "| | instances | max_batch_size | queue delay µs | gears | precision | concurrency | infer/s | p50 ms "
        f"| {q} ms | others' CPU | repeats | status |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for point in points:
        c, m = point.candidate, point.measurement
        mark = "★" if point is best else ("◆" if point in front else "")
        status = point.status + (f": {point.note}" if point.note else "")
        lines.append(" | ".join([
            f"| {mark}", str(c.instances), str(c.max_batch_size),
            "—" if c.queue_delay_us is None else str(c.queue_delay_us),
            ",".join(map(str, c.gears)) or "—", c.precision or "—", str(point.concurrency),
            f"{m.throughput:.0f}" if m else "", _cell(m.p50_us / 1000 if m else float("nan"), 2),
            _cell(point.latency_ms, 2), "" if point.others is None else f"{point.others:.0%}",
            str(point.repeats), status + " |",
        ]))  # fmt: skip
    return "\n".join(lines) + "\n"
