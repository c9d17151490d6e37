"""Per-request latency observations behind `--metrics-config`: sliding-window quantiles and a histogram."""

from __future__ import annotations

import bisect
import math
import random
import threading
import time
from collections.abc import Sequence

import numpy as np

from geserve.metrics.config import DEFAULT_FIRST_RESPONSE_BUCKETS_MS, MetricsConfig

# The summary families, in Triton's order; each observes microseconds.
SUMMARY_FAMILIES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# prometheus-cpp's defaults, which Triton's summaries use: a 60 s window in 5 age buckets.
MAX_AGE_S = 60.0
AGE_BUCKETS = 5


class _Slot:
    """The observations of one age bucket. Past `cap` of them it keeps a uniform sample (reservoir sampling,
    Li's algorithm L: it draws how many observations to skip, so most cost one comparison)."""

    __slots__ = ("_weight", "cap", "epoch", "next", "seen", "values")

    def __init__(self, cap: int, epoch: int = -1) -> None:
        self.cap = cap
        self.epoch = epoch
        self.seen = 0
        self.values: list[float] = []
        self.next = 0  # index of the next observation that enters the full reservoir
        self._weight = 0.0

    def add(self, value: float, times: int) -> None:
        end = self.seen + times
        room = self.cap - len(self.values)
        if room > 0:
            kept = min(room, times)
            if kept == 1:
                self.values.append(value)
            else:
                self.values.extend([value] * kept)
            self.seen += kept
            if len(self.values) < self.cap:
                return
            self._weight = math.exp(math.log(_uniform()) / self.cap)
            self.next = self.seen - 1
            self._advance()
        while self.next < end:
            self.values[random.randrange(self.cap)] = value
            self._weight *= math.exp(math.log(_uniform()) / self.cap)
            self._advance()
        self.seen = end

    def _advance(self) -> None:
        gap = min(max(1.0 - self._weight, 1e-300), 1.0 - 1e-16)  # log(gap) < 0: a finite skip
        self.next += int(math.log(_uniform()) / math.log(gap)) + 1


def _uniform() -> float:
    """A uniform number in (0, 1)."""
    return random.random() or 0.5


class WindowedQuantiles:
    """Quantiles over the last `max_age_s` seconds (as prometheus-cpp: 60 s in 5 age buckets), plus the
    all-time count and sum a Prometheus summary reports.

    Quantiles are exact over what a window holds; past `cap` observations per age bucket they come from a
    uniform sample of it, each bucket weighted by how many it saw.
    """

    def __init__(
        self, max_age_s: float = MAX_AGE_S, age_buckets: int = AGE_BUCKETS, cap: int = 2048,
        lock: threading.Lock | None = None,
    ) -> None:
        self._step = max_age_s / age_buckets
        self._slots = [_Slot(cap) for _ in range(age_buckets)]
        self._cap = cap
        self.lock = lock or threading.Lock()
        self.count = 0
        self.sum = 0.0

    def epoch(self) -> int:
        return int(time.monotonic() / self._step)

    def observe(self, value: float, times: int = 1) -> None:
        epoch = self.epoch()
        with self.lock:
            self.add(value, times, epoch)

    def add(self, value: float, times: int, epoch: int) -> None:
        """`observe` for a caller that holds `lock` and read `epoch()` already (several observations at once)."""
        self.count += times
        self.sum += value * times
        index = epoch % len(self._slots)
        slot = self._slots[index]
        if slot.epoch != epoch:
            slot = self._slots[index] = _Slot(self._cap, epoch)
        if slot.seen < slot.next and slot.seen + times <= slot.next:
            slot.seen += times  # a full reservoir skipping this one: the common case under load
        else:
            slot.add(value, times)

    def snapshot(self, quantiles: Sequence[float]) -> tuple[int, float, list[float]]:
        """(count, sum, the value at each quantile); NaN quantiles while the window is empty."""
        oldest = self.epoch() - len(self._slots) + 1
        with self.lock:
            live = [(list(s.values), s.seen) for s in self._slots if s.epoch >= oldest and s.values]
            count, total = self.count, self.sum
        if not live:
            return count, total, [math.nan] * len(quantiles)
        values = np.concatenate([np.asarray(v, dtype=np.float64) for v, _ in live])
        weights = np.concatenate([np.full(len(v), seen / len(v)) for v, seen in live])
        order = np.argsort(values, kind="stable")
        values, cumulative = values[order], np.cumsum(weights[order])
        ranks = np.searchsorted(cumulative, [q * cumulative[-1] for q in quantiles], side="left")
        return count, total, [float(values[min(int(r), len(values) - 1)]) for r in ranks]


class BucketHistogram:
    """A cumulative Prometheus histogram: counts per `le` bound, count and sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[int], float]:
        """(cumulative counts for each bound and +Inf, sum)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, cumulative = 0, []
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, total


class LatencyRecorder:
    """One model version's observations, fed by its ModelStatistics (the `LatencyObserver` protocol)."""

    def __init__(self, config: MetricsConfig) -> None:
        self._lock = threading.Lock()  # one for all the summaries: one acquisition per update
        self.summaries = (
            {f: WindowedQuantiles(lock=self._lock) for f in SUMMARY_FAMILIES} if config.summary_latencies else {}
        )
        self.first_response = (
            BucketHistogram(DEFAULT_FIRST_RESPONSE_BUCKETS_MS) if config.histogram_latencies else None
        )

    def request(self, ok: bool, duration_ns: int) -> None:
        if not ok:  # as Triton: the request summary counts successful requests
            return
        if self.summaries:
            self.summaries["request"].observe(duration_ns // 1000)
        if self.first_response is not None:
            self.first_response.observe(duration_ns / 1e6)

    def execution(self, request_count: int, queue_ns: list[int], input_ns: int, infer_ns: int, output_ns: int) -> None:
        if not self.summaries:
            return
        summaries = self.summaries
        queue = summaries["queue"]
        epoch = queue.epoch()
        with self._lock:
            for ns in queue_ns:
                queue.add(ns // 1000, 1, epoch)
            # Each request of the batch is charged the whole batch's compute, as in the counters.
            summaries["compute_input"].add(input_ns // 1000, request_count, epoch)
            summaries["compute_infer"].add(infer_ns // 1000, request_count, epoch)
            summaries["compute_output"].add(output_ns // 1000, request_count, epoch)
