"""The sweep: each candidate loaded once, measured at rising concurrency until its latency leaves the budget, each
measurement repeated when other processes took the CPUs meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass

from geserve.config import ModelConfig
from geserve.tune import machine
from geserve.tune.perf_analyzer import Measurement, measure
from geserve.tune.progress import Progress
from geserve.tune.server import TuneServer, TuneServerError
from geserve.tune.space import Candidate, apply

MEASURED, OVER_BUDGET, SKIPPED, FAILED = "measured", "over budget", "skipped", "failed"


@dataclass(frozen=True)
class SweepOptions:
    model: str
    concurrencies: tuple[int, ...] = (1, 4, 16)
    budget_ms: float = 20.0
    protocol: str = "http"
    percentile: int = 99
    window_ms: int = 1000  # perf_analyzer --measurement-interval
    stability: int = 50  # perf_analyzer --stability-percentage
    max_trials: int = 5
    busy_limit: float = 0.15  # share of the CPUs others may use before a point is measured again
    max_repeats: int = 2
    quiet_wait_s: float = 60.0  # the whole sweep's time for waiting on other processes to leave the CPUs
    perf_analyzer_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Point:
    candidate: Candidate
    concurrency: int
    status: str  # MEASURED, OVER_BUDGET, SKIPPED, FAILED
    measurement: Measurement | None = None
    others: float | None = None  # share of the CPUs other processes used during the kept measurement
    repeats: int = 0
    note: str = ""

    @property
    def latency_ms(self) -> float:
        return self.measurement.latency_us / 1000 if self.measurement else float("nan")

    @property
    def throughput(self) -> float:
        return self.measurement.throughput if self.measurement else 0.0


class Sweep:
    def __init__(self, server: TuneServer, base: ModelConfig, options: SweepOptions, progress: Progress) -> None:
        self.server, self.base, self.options, self.progress = server, base, options, progress
        self.quiet_left_s = options.quiet_wait_s

    def run(self, candidates: list[Candidate]) -> list[Point]:
        points: list[Point] = []
        for candidate in candidates:
            points += self.candidate(candidate)
        self.progress.finish()
        return points

    def candidate(self, candidate: Candidate) -> list[Point]:
        levels = sorted(set(self.options.concurrencies))
        self.progress.start(f"{candidate.label}: loading")
        try:
            self.server.load(self.options.model, apply(self.base, candidate))
        except TuneServerError as exc:
            self.progress.note(f"{candidate.label}: load failed: {exc}")
            self.progress.advance(len(levels))
            return [Point(candidate, c, FAILED, note=f"load failed: {exc}") for c in levels]
        self._warm_up()
        points: list[Point] = []
        over_at = 0
        for c in levels:
            if over_at:
                note = f"p{self.options.percentile} over budget at c={over_at}"
                points.append(Point(candidate, c, SKIPPED, note=note))
                self.progress.advance()
                continue
            self.progress.start(f"{candidate.label} c={c}")
            point = self._measure(candidate, c)
            points.append(point)
            self.progress.advance()
            if point.status == OVER_BUDGET:
                over_at = c
                if c != levels[-1]:
                    self.progress.note(f"{candidate.label}: p{self.options.percentile} {point.latency_ms:.1f} ms "
                                       f"over the budget at c={c}; higher concurrency skipped")
        return points

    def _run(self, concurrency: int, window_ms: int, stability: int, max_trials: int) -> tuple[Measurement | None, str]:
        o = self.options
        return measure(o.model, self.server.url(o.protocol), o.protocol, concurrency, window_ms=window_ms,
                       percentile=o.percentile, stability=stability, max_trials=max_trials,
                       extra_args=o.perf_analyzer_args)

    def _warm_up(self) -> None:
        """A short unrecorded run, so first-call costs (session warm-up, allocations) stay out of the windows."""
        self._run(1, min(300, self.options.window_ms), 100, 2)

    def _measure(self, candidate: Candidate, concurrency: int) -> Point:
        o = self.options
        measurement, output, others, repeats = self._measure_quietly(candidate, concurrency)
        note = f"machine busy ({others:.0%} used by others)" if self._busy(others) and others is not None else ""
        if measurement is None:
            self.progress.note(f"{candidate.label} c={concurrency}: perf_analyzer gave no result: {output[-300:]}")
            return Point(candidate, concurrency, FAILED, None, others, repeats, "perf_analyzer gave no result")
        within = measurement.latency_us <= o.budget_ms * 1000
        return Point(candidate, concurrency, MEASURED if within else OVER_BUDGET, measurement, others, repeats, note)

    def _measure_quietly(
        self, candidate: Candidate, concurrency: int
    ) -> tuple[Measurement | None, str, float | None, int]:
        """perf_analyzer's measurement and output, the others' CPU share during it, and the repeats it took: a
        measurement on a busy machine is repeated while repeats and the sweep's quiet-wait time last."""
        o = self.options
        repeats = 0
        while True:
            with machine.others_share() as share:
                measurement, output = self._run(concurrency, o.window_ms, o.stability, o.max_trials)
            others = share[0] if share else None
            if not self._busy(others) or repeats >= o.max_repeats or self.quiet_left_s <= 0:
                return measurement, output, others, repeats
            repeats += 1
            self.progress.note(f"{candidate.label} c={concurrency}: other processes used {others:.0%} of the CPUs; "
                               f"measuring again ({repeats}/{o.max_repeats})")
            self._wait_for_quiet()

    def _busy(self, others: float | None) -> bool:
        return others is not None and others > self.options.busy_limit

    def _wait_for_quiet(self) -> None:
        started = time.monotonic()
        machine.wait_for_quiet(self.options.busy_limit, min(20.0, self.quiet_left_s))
        self.quiet_left_s -= time.monotonic() - started
