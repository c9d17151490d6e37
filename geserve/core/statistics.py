"""Per-model-version inference statistics in Triton's shape (what `/stats` returns and perf_analyzer reads)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStatistics:
    """Updated from worker threads and the event loop alike, so every update takes the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, BatchStats] = {}

    def record_request(self, ok: bool, duration_ns: int) -> None:
        with self._lock:
            (self.success if ok else self.fail).add(duration_ns)
            if ok:
                self.last_inference_ms = int(time.time() * 1000)

    def record_execution(
        self, request_count: int, batch_rows: int, queue_ns: list[int], input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One execution of a batch: each request in it is charged the whole batch's compute, as in Triton."""
        with self._lock:
            self.execution_count += 1
            self.inference_count += batch_rows
            for ns in queue_ns:
                self.queue.add(ns)
            self.compute_input.add(input_ns * request_count, request_count)
            self.compute_infer.add(infer_ns * request_count, request_count)
            self.compute_output.add(output_ns * request_count, request_count)
            batch = self.batches.setdefault(batch_rows, BatchStats())
            batch.compute_input.add(input_ns)
            batch.compute_infer.add(infer_ns)
            batch.compute_output.add(output_ns)

    def as_json(self, name: str, version: str) -> dict[str, Any]:
        with self._lock:
            zero = Duration().as_json()
            return {
                "name": name,
                "version": version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.as_json(),
                    "fail": self.fail.as_json(),
                    "queue": self.queue.as_json(),
                    "compute_input": self.compute_input.as_json(),
                    "compute_infer": self.compute_infer.as_json(),
                    "compute_output": self.compute_output.as_json(),
                    "cache_hit": zero,
                    "cache_miss": zero,
                },
                "response_stats": {},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": stats.compute_input.as_json(),
                        "compute_infer": stats.compute_infer.as_json(),
                        "compute_output": stats.compute_output.as_json(),
                    }
                    for size, stats in sorted(self.batches.items())
                ],
                "memory_usage": [],
            }
