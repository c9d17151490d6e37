"""Adaptive batching: tunes the batch limit and queue delay from measured latencies to hold a p99 target.

The strategy of the Ascend deployment guides, made continuous: above the target, halve the queue delay, then
the batch limit; below 80% of it, double the batch limit back, then grow the delay, but only while
requests really share batches (a delay never helps a lone request: at concurrency 1 it stays 0).
One exception, measured in bench/adaptive_batching.py: when requests are still queued after most batches
leave, latency is queueing, not batch execution, so smaller batches would only make it worse; then the
limit goes back up instead.
"""

from __future__ import annotations

import time

import numpy as np

_WINDOW = 256  # latencies per decision
_MIN_INTERVAL_NS = 200_000_000  # at most five decisions a second
_HEADROOM = 0.8  # grow only while p99 is below 80% of the target
_SHARED_BATCHES = 1.5  # mean rows per execution above which waiting can fill batches


class AdaptiveController:
    def __init__(self, target_p99_ms: float, max_batch_size: int, max_delay_ns: int) -> None:
        self.target_ns = int(target_p99_ms * 1e6)
        self.max_batch_size = max_batch_size
        # The configured delay is the ceiling; without one, allow up to a quarter of the target.
        self.max_delay_ns = max_delay_ns or self.target_ns // 4
        self.batch_limit = max_batch_size
        self.delay_ns = 0
        self.last_p99_ns = 0
        self._samples: list[int] = []
        self._executions = 0
        self._backlogged = 0
        self._last_decision = time.monotonic_ns()

    def observe(self, latencies_ns: list[int], backlogged: bool = False) -> None:
        """The end-to-end latencies of the requests of one execution; `backlogged`: requests were left queued."""
        self._samples.extend(latencies_ns)
        self._executions += 1
        self._backlogged += backlogged
        now = time.monotonic_ns()
        if len(self._samples) < _WINDOW and now - self._last_decision < _MIN_INTERVAL_NS:
            return
        if len(self._samples) < 8:
            return
        self.last_p99_ns = int(np.percentile(self._samples, 99))
        mean_batch = len(self._samples) / max(1, self._executions)
        backlog = self._backlogged / max(1, self._executions)
        self._samples.clear()
        self._executions = self._backlogged = 0
        self._last_decision = now
        self.decide(self.last_p99_ns, mean_batch, backlog)

    def decide(self, p99_ns: int, mean_batch: float = 2.0, backlog: float = 0.0) -> None:
        """`backlog`: the share of executions that left requests queued behind them."""
        if p99_ns > self.target_ns:
            if backlog > 0.5:
                self.delay_ns = 0  # overloaded: only throughput shortens the queue
                self.batch_limit = min(self.max_batch_size, self.batch_limit * 2)
            elif self.delay_ns:
                self.delay_ns //= 2
            else:
                self.batch_limit = max(1, self.batch_limit // 2)
        elif p99_ns < self.target_ns * _HEADROOM:
            if self.batch_limit < self.max_batch_size:
                self.batch_limit = min(self.max_batch_size, self.batch_limit * 2)
            elif mean_batch >= _SHARED_BATCHES and self.delay_ns < self.max_delay_ns:
                self.delay_ns = min(self.max_delay_ns, max(50_000, self.delay_ns * 2))
