"""Per-model-version inference statistics in Triton's shape (what `/stats` returns and perf_analyzer reads)."""

from __future__ import annotations

import bisect
import copy
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from geserve.errors import ErrorCode, GeserveError

# Bounds of the queue-time histogram (seconds): from what a dynamic batcher's delay adds to what no caller waits for.
QUEUE_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BOUNDS_NS = tuple(int(bound * 1e9) for bound in QUEUE_BOUNDS_S)
# Triton's `reason` label of nv_inference_request_failure, and geserve's own for a request whose deadline passed.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER", "DEADLINE_EXCEEDED")
_REASON_BY_CODE = {
    ErrorCode.UNAVAILABLE: "REJECTED",  # a full queue, a queue timeout, a model that is unloading
    ErrorCode.CANCELLED: "CANCELED",
    ErrorCode.INTERNAL: "BACKEND",  # the backend failed to execute (e.g. ONNX Runtime raised)
    # Refused before any model ran. Admission refusals are raised before the model is looked up, so they never
    # reach a model's statistics; a refusal raised later (a nested call) would count as rejected.
    ErrorCode.UNAUTHENTICATED: "REJECTED",
    ErrorCode.PERMISSION_DENIED: "REJECTED",
}


def failure_reason(error: BaseException | None) -> str:
    """The failure reason of `error`: the one it names when it names one, else the one its code implies."""
    if not isinstance(error, GeserveError):
        return "OTHER"
    if error.failure_reason in FAILURE_REASONS:
        return error.failure_reason
    return _REASON_BY_CODE.get(error.code, "OTHER")


class LatencyObserver(Protocol):
    """Per-request latency observations (for latency summaries / histograms); installed only when configured."""

    def request(self, ok: bool, duration_ns: int) -> None: ...

    def execution(
        self, request_count: int, queue_ns: list[int], input_ns: int, infer_ns: int, output_ns: int
    ) -> None: ...


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
    """Updated from worker threads and the event loop alike, so every update takes the lock.

    `latency_observer` is given only when latency summaries or histograms are configured; without one the hot
    path pays one attribute test.
    """

    def __init__(self, latency_observer: LatencyObserver | None = None) -> None:
        self._lock = threading.Lock()
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.cache_hit = Duration()  # requests answered from the response cache, and their lookup time
        self.cache_miss = Duration()  # cached models' requests that ran, and their lookup + insertion time
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, BatchStats] = {}
        self.fail_by_reason: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self.busy_ns = 0  # the executions' own time, each counted once (not per request): admission's service time
        self.queue_buckets = [0] * (len(QUEUE_BOUNDS_S) + 1)  # ge_inference_queue_duration_seconds, not cumulative
        self.latency_observer = latency_observer

    def record_success(self, duration_ns: int) -> None:
        self.record_request(True, duration_ns)

    def record_failure(self, duration_ns: int, error: BaseException | None) -> None:
        """One failed request, counted under the reason `error` implies (see failure_reason)."""
        self.record_request(False, duration_ns, failure_reason(error))

    def record_request(self, ok: bool, duration_ns: int, reason: str = "OTHER") -> None:
        """One request done; a failure is counted under `reason` (one of FAILURE_REASONS)."""
        why = "" if ok else reason
        with self._lock:
            (self.success if ok else self.fail).add(duration_ns)
            if ok:
                self.last_inference_ms = int(time.time() * 1000)
            else:
                self.fail_by_reason[why] = self.fail_by_reason.get(why, 0) + 1
        observer = self.latency_observer
        if observer is not None:
            observer.request(ok, duration_ns)

    def record_cache_hit(self, duration_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache, as Triton counts it: a success that ran nothing. Its queue
        and compute counts grow with no time (Triton reports them as the success count), inference and execution
        counts do not; `cache_hit` gets its lookup time."""
        with self._lock:
            self.success.add(duration_ns)
            self.cache_hit.add(lookup_ns)
            for nothing in (self.queue, self.compute_input, self.compute_infer, self.compute_output):
                nothing.add(0)
        observer = self.latency_observer
        if observer is not None:
            observer.request(True, duration_ns)

    def record_cache_miss(self, lookup_ns: int, insert_ns: int) -> None:
        """A cached model's request that ran and succeeded (already counted): `cache_miss` gets its lookup and
        insertion time, and the insertion, done after the request's duration was taken, joins that duration."""
        with self._lock:
            self.success.ns += insert_ns
            self.cache_miss.add(lookup_ns + insert_ns)

    def record_execution(
        self,
        request_count: int,
        batch_rows: int,
        queue_ns: list[int],
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        batch_size: int = 0,
    ) -> None:
        """One execution of a batch: each request in it is charged the whole batch's compute, as in Triton.
        `batch_size` (default: `batch_rows`) keys the batch statistics: a sequence batcher's batch also holds the
        null requests of its empty slots, which Triton counts in the batch's size but not as inferences."""
        with self._lock:
            self.execution_count += 1
            self.inference_count += batch_rows
            buckets = self.queue_buckets
            for ns in queue_ns:
                self.queue.add(ns)
                buckets[bisect.bisect_left(QUEUE_BOUNDS_NS, ns)] += 1
            self.busy_ns += input_ns + infer_ns + output_ns
            self.compute_input.add(input_ns * request_count, request_count)
            self.compute_infer.add(infer_ns * request_count, request_count)
            self.compute_output.add(output_ns * request_count, request_count)
            key = batch_size or batch_rows
            batch = self.batches.get(key)
            if batch is None:  # not setdefault: that would build a BatchStats on every execution
                batch = self.batches[key] = BatchStats()
            batch.compute_input.add(input_ns)
            batch.compute_infer.add(infer_ns)
            batch.compute_output.add(output_ns)
        observer = self.latency_observer
        if observer is not None:
            observer.execution(request_count, queue_ns, input_ns, infer_ns, output_ns)

    def execution_totals(self) -> tuple[int, int]:
        """Inferences made and the time their executions took, so far."""
        with self._lock:
            return self.inference_count, self.busy_ns

    def queue_histogram(self) -> tuple[list[int], float]:
        """The queue-time histogram: cumulative counts per bound of QUEUE_BOUNDS_S (and +Inf), and the sum (s)."""
        with self._lock:
            counts, total_ns = list(self.queue_buckets), self.queue.ns
        return list(itertools.accumulate(counts)), total_ns / 1e9

    def failures_by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self.fail_by_reason)

    def as_json(self, name: str, version: str) -> dict[str, Any]:
        with self._lock:
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
                    "cache_hit": self.cache_hit.as_json(),
                    "cache_miss": self.cache_miss.as_json(),
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


def merge_statistics(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The `{"model_stats": [...]}` answers of several workers of one server as one: counts and times added per
    model version (and per batch size), the last inference the latest of them, in the first answer's order."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for answer in answers:
        for stats in answer["model_stats"]:
            key = (stats["name"], stats["version"])
            if key in merged:
                _add_into(merged[key], stats)
            else:
                merged[key] = copy.deepcopy(stats)
    return {"model_stats": list(merged.values())}


def _add_into(total: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if key == "last_inference":
            total[key] = max(total[key], value)
        elif key == "batch_stats":
            total[key] = _merge_batch_stats(total[key], value)
        elif isinstance(value, dict):
            _add_into(total.setdefault(key, {}), value)
        elif isinstance(value, int) and key not in ("batch_size", "version", "name"):
            total[key] = total.get(key, 0) + value


def _merge_batch_stats(total: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two workers' `batch_stats` as one, added per batch size, in size order."""
    by_size = {entry["batch_size"]: entry for entry in total}
    for entry in other:
        if entry["batch_size"] in by_size:
            _add_into(by_size[entry["batch_size"]], entry)
        else:
            by_size[entry["batch_size"]] = copy.deepcopy(entry)
    return [by_size[size] for size in sorted(by_size)]
