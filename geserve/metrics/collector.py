"""The scrape-time collector: Triton's nv_* families and geserve's ge_* ones, read from the model manager.

Nothing here runs on the inference path: counters come from each model's ModelStatistics, gauges from the
manager and the schedulers, when Prometheus scrapes. Device families (`ge_device_*`, reported where a device
can report them) register their own collector into the same injected registry, and so do the custom families
Python models create (`custom.CustomMetricStore`), after all of these.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from geserve.metrics.config import MetricsConfig
from geserve.metrics.custom import CustomMetricStore
from geserve.metrics.exposition import format_value
from geserve.metrics.latency import SUMMARY_FAMILIES, LatencyRecorder
from geserve.metrics.system import CpuSampler, cpu_families
from geserve.repository.budget import LOAD_BOUNDS_S, LoadHistogram, ModelLoads
from geserve.repository.model import LoadedModel, ModelState
from geserve.statistics import FAILURE_REASONS, QUEUE_BOUNDS_S

if TYPE_CHECKING:  # the lifecycle imports the backends, whose Python backend imports geserve.metrics
    from geserve.repository.lifecycle import ModelManager

_COUNTS = (
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "inference_count"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "execution_count"),
)
# (family, help, statistics key): cumulative microseconds.
_DURATIONS = (
    ("nv_inference_request_duration_us",
     "Cumulative inference request duration in microseconds (includes cached requests)", "success"),
    ("nv_inference_queue_duration_us",
     "Cumulative inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("nv_inference_compute_input_duration_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)", "compute_input"),
    ("nv_inference_compute_infer_duration_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)", "compute_infer"),
    ("nv_inference_compute_output_duration_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     "compute_output"),
)
# Triton's per-model response cache counters (family, help, statistics key, in microseconds rather than a count):
# created, as Triton creates them, only for models that use the cache, and like the durations only while
# counter_latencies is on.
_CACHE_COUNTERS = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit", False),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", "cache_hit", True),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss", False),
    ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in microseconds",
     "cache_miss", True),
)
_SUMMARIES = dict(zip(SUMMARY_FAMILIES, (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)"),
    ("nv_inference_compute_input_summary_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_infer_summary_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
), strict=True))
# Optional counters other parts of geserve may keep on ModelStatistics: (attribute, family, help).
_OPTIONAL_COUNTERS = (
    ("padding_rows", "ge_batch_padding_rows_total", "Rows of padding added to fill batch gears"),
    ("allocation_failures", "ge_memory_pool_allocation_failures_total", "Failed memory-pool allocations"),
)
# The memory budget's and load on demand's families (BudgetCollector).
BUDGET_FAMILY_NAMES = ("ge_memory_budget_bytes", "ge_model_memory_bytes", "ge_model_evictions_total",
                       "ge_model_load_on_demand_total", "ge_model_load_duration_seconds")
# Every family this collector may write: custom families cannot take these names.
SERVER_FAMILY_NAMES = frozenset({
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_pending_request_count",
    "nv_model_load_duration_secs", "nv_inference_first_response_histogram_ms", "nv_cpu_utilization",
    "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes", "ge_batch_size", "ge_model_instances", "ge_model_state",
    "ge_inference_path_total", "ge_inference_queue_duration_seconds", "ge_overload_concurrency_limit",
    "ge_overload_shed_total", *BUDGET_FAMILY_NAMES,
    *(name for name, _, _ in _COUNTS), *(name for name, _, _ in _DURATIONS), *(name for name, _ in _SUMMARIES.values()),
    *(name for _, name, _ in _OPTIONAL_COUNTERS), *(name for name, _, _, _ in _CACHE_COUNTERS),
})


def _labels(model: LoadedModel, **extra: str) -> dict[str, str]:
    return {"model": model.name, "version": str(model.version), **extra}


def _family(name: str, documentation: str, kind: str) -> Metric:
    return Metric(name, documentation, kind)


def batch_bounds(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to the model's max_batch_size (itself the last bound); [1] for a non-batching model."""
    bounds, size = [], 1
    while size < max_batch_size:
        bounds.append(size)
        size *= 2
    bounds.append(max(1, max_batch_size))
    return bounds


class InferenceCollector:
    def __init__(self, manager: ModelManager, config: MetricsConfig, cpu: CpuSampler | None = None) -> None:
        self._manager = manager
        self._config = config
        self._cpu = cpu

    def collect(self) -> Iterator[Metric]:
        models = sorted(self._manager.models(), key=lambda m: (m.name, m.version))
        stats = [(m, m.statistics.as_json(m.name, str(m.version))) for m in models]
        yield from self._requests(stats)
        if self._config.counter_latencies:
            yield from self._durations(stats)
            yield from self._cache_counters(stats)
        yield from self._model_gauges(models)
        if self._cpu is not None and self._cpu.latest is not None:
            yield from cpu_families(self._cpu.latest)
        recorders = [(m, m.statistics.latency_observer) for m in models]
        live = [(m, r) for m, r in recorders if isinstance(r, LatencyRecorder)]
        if self._config.summary_latencies:
            yield from self._summaries(live)
        if self._config.histogram_latencies:
            yield from self._first_response(live)
        yield from self._batch_sizes(stats)
        yield from self._queue_times(models)
        yield from self._admission(models)
        yield from self._geserve_gauges(models)
        yield from self._optional_counters(models)

    def _requests(self, stats: list[tuple[LoadedModel, dict[str, Any]]]) -> Iterator[Metric]:
        success = _family("nv_inference_request_success",
                          "Number of successful inference requests, all batch sizes", "counter")
        failure = _family("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
                          "counter")
        for model, json in stats:
            success.add_sample(success.name, _labels(model), json["inference_stats"]["success"]["count"])
            reasons = model.statistics.failures_by_reason()
            for reason in FAILURE_REASONS:
                labels = {"model": model.name, "reason": reason, "version": str(model.version)}
                failure.add_sample(failure.name, labels, reasons.get(reason, 0))
        yield success
        yield failure
        for name, documentation, key in _COUNTS:
            family = _family(name, documentation, "counter")
            for model, json in stats:
                family.add_sample(name, _labels(model), json[key])
            yield family

    def _durations(self, stats: list[tuple[LoadedModel, dict[str, Any]]]) -> Iterator[Metric]:
        for name, documentation, key in _DURATIONS:
            family = _family(name, documentation, "counter")
            for model, json in stats:
                family.add_sample(name, _labels(model), json["inference_stats"][key]["ns"] // 1000)
            yield family

    def _cache_counters(self, stats: list[tuple[LoadedModel, dict[str, Any]]]) -> Iterator[Metric]:
        cached = [(model, json["inference_stats"]) for model, json in stats if model.response_cache]
        if not cached:  # no family at all, as Triton's output without a cached model
            return
        for name, documentation, key, microseconds in _CACHE_COUNTERS:
            family = _family(name, documentation, "counter")
            for model, inference in cached:
                value = inference[key]["ns"] // 1000 if microseconds else inference[key]["count"]
                family.add_sample(name, _labels(model), value)
            yield family

    def _model_gauges(self, models: list[LoadedModel]) -> Iterator[Metric]:
        pending = _family("nv_inference_pending_request_count",
                          "Instantaneous number of pending requests awaiting execution per-model.", "gauge")
        load = _family("nv_model_load_duration_secs", "Model load time in seconds", "gauge")
        for model in models:
            pending.add_sample(pending.name, _labels(model), model.scheduler.inflight_count)
            record = self._manager.record(model.name)
            load.add_sample(load.name, _labels(model), record.load_seconds if record is not None else 0.0)
        yield pending
        yield load

    def _summaries(self, live: list[tuple[LoadedModel, LatencyRecorder]]) -> Iterator[Metric]:
        quantiles = [q for q, _ in self._config.summary_quantiles]
        for key, (name, documentation) in _SUMMARIES.items():
            family = _family(name, documentation, "summary")
            for model, recorder in live:
                count, total, values = recorder.summaries[key].snapshot(quantiles)
                family.add_sample(name + "_count", _labels(model), count)
                family.add_sample(name + "_sum", _labels(model), total)
                for quantile, value in zip(quantiles, values, strict=True):
                    family.add_sample(name, _labels(model, quantile=format_value(quantile)), value)
            yield family

    def _first_response(self, live: list[tuple[LoadedModel, LatencyRecorder]]) -> Iterator[Metric]:
        name = "nv_inference_first_response_histogram_ms"
        family = _family(name, "Duration from request to first response in milliseconds", "histogram")
        for model, recorder in live:
            if recorder.first_response is not None:
                histogram = recorder.first_response
                cumulative, total = histogram.snapshot()
                _add_histogram(family, model, [*histogram.bounds], cumulative, total)
        yield family

    def _batch_sizes(self, stats: list[tuple[LoadedModel, dict[str, Any]]]) -> Iterator[Metric]:
        family = _family("ge_batch_size", "Rows per model execution (the executed batch size)", "histogram")
        for model, json in stats:
            bounds = batch_bounds(model.max_batch_size)
            per_size = [(b["batch_size"], b["compute_infer"]["count"]) for b in json["batch_stats"]]
            cumulative = [sum(n for size, n in per_size if size <= bound) for bound in bounds]
            cumulative.append(sum(n for _, n in per_size))
            total = sum(size * n for size, n in per_size)
            _add_histogram(family, model, [float(b) for b in bounds], cumulative, total)
        yield family

    def _queue_times(self, models: list[LoadedModel]) -> Iterator[Metric]:
        family = _family("ge_inference_queue_duration_seconds",
                         "Time requests waited in their model's queue before an execution took them", "histogram")
        for model in models:
            cumulative, total = model.statistics.queue_histogram()
            _add_histogram(family, model, list(QUEUE_BOUNDS_S), cumulative, total)
        yield family

    def _admission(self, models: list[LoadedModel]) -> Iterator[Metric]:
        """Admission control's state, for the models it controls (--overload-control, `overload_control`)."""
        limit = _family("ge_overload_concurrency_limit", "Adaptive concurrency limit of each model version", "gauge")
        shed = _family("ge_overload_shed_total", "Requests refused by admission control, by reason", "counter")
        for model in models:
            admission = model.admission
            if admission is None:
                continue
            limit.add_sample(limit.name, _labels(model), int(admission.limit))
            for reason, count in admission.shed.items():
                shed.add_sample(shed.name, _labels(model, reason=reason), count)
        yield limit
        yield shed

    def _geserve_gauges(self, models: list[LoadedModel]) -> Iterator[Metric]:
        instances = _family("ge_model_instances", "Execution instances of each model version", "gauge")
        for model in models:
            instances.add_sample(instances.name, _labels(model), sum(g.count for g in model.config.instance_group))
        yield instances
        state = _family("ge_model_state", "State of each model version: 1 for its current state, 0 for the others",
                        "gauge")
        for entry in self._manager.index():
            current = entry.get("state")
            if current is None:
                continue
            for candidate in ModelState:
                labels = {"model": entry["name"], "state": candidate.value, "version": entry.get("version", "")}
                state.add_sample(state.name, labels, 1 if candidate.value == current else 0)
        yield state

    def _optional_counters(self, models: list[LoadedModel]) -> Iterator[Metric]:
        for attribute, name, documentation in _OPTIONAL_COUNTERS:
            family = _family(name, documentation, "counter")
            for model in models:
                value = getattr(model.statistics, attribute, None)
                if value is not None:
                    family.add_sample(name, _labels(model), value)
            yield family


def _add_histogram(
    family: Metric, model: LoadedModel, bounds: list[float], cumulative: list[int], total: float
) -> None:
    for bound, count in zip([*bounds, float("inf")], cumulative, strict=True):
        family.add_sample(family.name + "_bucket", _labels(model, le=format_value(bound)), count)
    family.add_sample(family.name + "_sum", _labels(model), total)
    family.add_sample(family.name + "_count", _labels(model), cumulative[-1])


class PathCollector:
    """ge_inference_path_total: how the service's one request path ran each inference (InferenceService.paths): at
    once on the loop, queued with a callback, or in a task."""

    def __init__(self, paths: Mapping[str, int]) -> None:
        self._paths = paths

    def collect(self) -> Iterator[Metric]:
        family = _family("ge_inference_path_total", "Inferences by how the request path ran them", "counter")
        for path, count in self._paths.items():
            family.add_sample(family.name, {"path": path}, count)
        yield family


class BudgetCollector:
    """The memory budget (`--model-memory-budget`) and load on demand, as the server's decider of loads sees them
    (repository/budget.py): in one process its own, with workers the supervisor's (reported once for the server)."""

    def __init__(self, loads: ModelLoads) -> None:
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        snapshot = self._loads.snapshot()
        if snapshot.limit is not None:
            budget = _family("ge_memory_budget_bytes", "The memory budget of the loaded models (--model-memory-budget)",
                             "gauge")
            budget.add_sample(budget.name, {}, snapshot.limit)
            yield budget
        charged = _family("ge_model_memory_bytes", "Memory each loaded model version costs, measured at its load (PSS "
                          "added, all workers together)", "gauge")
        for name, versions in sorted(snapshot.charges.items()):
            for version, size in sorted(versions.items()):
                charged.add_sample(charged.name, {"model": name, "version": str(version)}, size)
        yield charged
        for family, documentation, counts in (
            ("ge_model_evictions_total", "Models unloaded to make room under the memory budget", snapshot.evictions),
            ("ge_model_load_on_demand_total", "Models loaded because a request needed them", snapshot.on_demand),
        ):
            counter = _family(family, documentation, "counter")
            for name, count in sorted(counts.items()):
                counter.add_sample(family, {"model": name}, count)
            yield counter
        yield _load_histogram(snapshot.loads)


def _load_histogram(loads: LoadHistogram) -> Metric:
    family = _family("ge_model_load_duration_seconds", "Time loads under the budget or on demand took, eviction "
                     "included, by what asked for them (a request, or a load request, the start, a poll)", "histogram")
    for trigger, counts in sorted(loads.buckets.items()):
        for bound, count in zip([*LOAD_BOUNDS_S, float("inf")], itertools.accumulate(counts), strict=True):
            family.add_sample(family.name + "_bucket", {"trigger": trigger, "le": format_value(bound)}, count)
        family.add_sample(family.name + "_sum", {"trigger": trigger}, loads.sums.get(trigger, 0.0))
        family.add_sample(family.name + "_count", {"trigger": trigger}, sum(counts))
    return family


def build_registry(
    manager: ModelManager, config: MetricsConfig, cpu: CpuSampler | None = None,
    custom: CustomMetricStore | None = None, paths: Mapping[str, int] | None = None,
    loads: ModelLoads | None = None,
) -> CollectorRegistry:
    """The server's one registry (never prometheus_client's global one): the inference collector, the budget's
    (`loads`: the decider of loads, when this process has one), then the custom families of Python models."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InferenceCollector(manager, config, cpu))
    if paths is not None:
        registry.register(PathCollector(paths))
    if loads is not None:
        registry.register(BudgetCollector(loads))
    if custom is not None:
        registry.register(custom)
    return registry
