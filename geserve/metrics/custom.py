"""Custom metric families that models create at run time (Triton's TRITONSERVER_MetricFamily / _Metric API).

A thread-safe store, written to at inference time and read by /metrics as one more collector of the server's
registry; refusals come as CustomMetricError in the words of Triton's core.
"""

from __future__ import annotations

import bisect
import collections
import math
import re
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import ClassVar

from prometheus_client.core import Metric

from geserve.metrics.exposition import format_value

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)
_TRITON_KINDS = {COUNTER: "COUNTER", GAUGE: "GAUGE", HISTOGRAM: "HISTOGRAM"}

# prometheus-cpp's rules, which Triton applies: names starting with `__` are reserved for Prometheus itself.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

LabelKey = tuple[tuple[str, str], ...]


class CustomMetricError(ValueError):
    """A refused metric operation; the message is Triton core's."""


def _unsupported(kind: str, operation: str) -> CustomMetricError:
    return CustomMetricError(f"TRITONSERVER_METRIC_KIND_{_TRITON_KINDS[kind]} does not support {operation}")


class Series:
    """One labelled time series of a family; each update is one lock and one arithmetic operation."""

    __slots__ = ("_lock", "_value", "labels")
    kind: ClassVar[str]

    def __init__(self, labels: LabelKey) -> None:
        self.labels = labels
        self._lock = threading.Lock()
        self._value = 0.0

    def increment(self, amount: float) -> None:
        raise _unsupported(self.kind, "Increment")

    def set(self, value: float) -> None:
        raise _unsupported(self.kind, "Set")

    def observe(self, value: float) -> None:
        raise _unsupported(self.kind, "Observe")

    def value(self) -> float:
        return self._value  # one float read: no lock needed under the GIL

    def add_samples(self, family: Metric) -> None:
        family.add_sample(family.name, dict(self.labels), self._value)


class CounterSeries(Series):
    __slots__ = ()
    kind = COUNTER

    def increment(self, amount: float) -> None:
        if amount < 0.0:
            raise CustomMetricError(
                "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."
            )
        with self._lock:
            self._value += amount


class GaugeSeries(Series):
    __slots__ = ()
    kind = GAUGE

    def increment(self, amount: float) -> None:
        with self._lock:
            self._value += amount

    def set(self, value: float) -> None:
        with self._lock:  # not to be lost under a concurrent increment
            self._value = value


class HistogramSeries(Series):
    """Cumulative buckets as Prometheus reads them; an observation equal to a bound counts in its bucket."""

    __slots__ = ("_count", "_counts", "bounds")
    kind = HISTOGRAM

    def __init__(self, labels: LabelKey, bounds: Sequence[float]) -> None:
        super().__init__(labels)
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._count += 1
            self._value += value

    def value(self) -> float:
        raise _unsupported(HISTOGRAM, "Value")

    def add_samples(self, family: Metric) -> None:
        with self._lock:
            counts, count, total = list(self._counts), self._count, self._value
        labels = dict(self.labels)
        # prometheus-cpp's order, which Triton writes: count, sum, then the buckets.
        family.add_sample(family.name + "_count", labels, count)
        family.add_sample(family.name + "_sum", labels, total)
        running = 0
        for bound, bucket in zip([*self.bounds, math.inf], counts, strict=True):
            running += bucket
            family.add_sample(family.name + "_bucket", {**labels, "le": format_value(bound)}, running)


_SERIES: dict[str, type[Series]] = {COUNTER: CounterSeries, GAUGE: GaugeSeries}


class CustomFamily:
    """A named family and its series, each counted by the handles (model-side objects) that hold it."""

    __slots__ = ("_series", "description", "handles", "kind", "name")

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.handles = 0
        self._series: dict[LabelKey, tuple[Series, int]] = {}


class CustomMetricStore:
    """Every custom family of the server. Families merge by name (the first description stays, another kind
    is refused) and series by labels; a series goes when its last handle is released, a family too.

    Releases may come from `__del__` of model-side objects, so at any point of any thread, even one inside
    this store: they are queued and applied by whoever next holds the lock (never re-entering it).
    """

    def __init__(self, reserved: Collection[str] = ()) -> None:
        self._reserved = frozenset(reserved)  # the server's own family names
        self._lock = threading.Lock()
        self._families: dict[str, CustomFamily] = {}
        self._releases: collections.deque[tuple[CustomFamily, Series | None]] = collections.deque()

    # ---- handles ------------------------------------------------------------------------------------

    def open_family(self, name: str, description: str, kind: str) -> CustomFamily:
        if kind not in KINDS:
            raise CustomMetricError("Unsupported kind passed to MetricFamily constructor.")
        if not _METRIC_NAME.fullmatch(name) or name.startswith("__"):
            raise CustomMetricError("Invalid metric name")
        with self._lock:
            self._apply_releases()
            family = self._families.get(name)
            if family is None and name in self._reserved:
                raise CustomMetricError(f"Family name already exists: '{name}' is one of the server's own families")
            if family is None:
                family = self._families[name] = CustomFamily(name, description, kind)
            elif family.kind != kind:
                raise CustomMetricError("Family name already exists with different type")
            family.handles += 1
            return family

    def open_series(
        self, family: CustomFamily, labels: Mapping[str, str], buckets: Sequence[float] | None = None
    ) -> Series:
        """The family's series with these labels, made on first use (a histogram's with these `buckets`)."""
        _check_labels(family, labels)
        _check_buckets(family, buckets)
        key = tuple(sorted(labels.items()))  # prometheus-cpp writes labels sorted by name
        with self._lock:
            self._apply_releases()
            series, refs = family._series.get(key, (None, 0))
            if series is None:
                series = HistogramSeries(key, buckets or ()) if family.kind == HISTOGRAM else _SERIES[family.kind](key)
            family._series[key] = (series, refs + 1)
            return series

    def release(self, family: CustomFamily, series: Series | None = None) -> None:
        """Drop one handle of `series` (or, with None, of `family`); safe from `__del__`."""
        self._releases.append((family, series))
        if self._lock.acquire(blocking=False):
            try:
                self._apply_releases()
            finally:
                self._lock.release()

    def _apply_releases(self) -> None:
        while self._releases:
            family, series = self._releases.popleft()
            if series is None:
                family.handles -= 1
                if family.handles <= 0 and self._families.get(family.name) is family:
                    del self._families[family.name]
                continue
            current, refs = family._series.get(series.labels, (None, 0))
            if current is series:
                if refs > 1:
                    family._series[series.labels] = (series, refs - 1)
                else:
                    del family._series[series.labels]

    # ---- scrape -------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """Counters, gauges, then histograms (Triton's order), each in the order made; series in the order made."""
        with self._lock:
            self._apply_releases()
            snapshot = [(f.name, f.description, f.kind, [s for s, _ in f._series.values()])
                        for f in self._families.values()]
        snapshot.sort(key=lambda family: KINDS.index(family[2]))
        for name, description, kind, series in snapshot:
            family = Metric(name, description, kind)
            for one in series:
                one.add_samples(family)
            yield family

    def family_names(self) -> list[str]:
        with self._lock:
            self._apply_releases()
            return list(self._families)


def _check_labels(family: CustomFamily, labels: Mapping[str, str]) -> None:
    for label in labels:
        if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
            raise CustomMetricError("Invalid label name")
        if label == "le" and family.kind == HISTOGRAM:
            # Triton accepts it and writes two `le` labels on every bucket, which Prometheus refuses.
            raise CustomMetricError("Invalid label name: 'le' is reserved for the buckets of a histogram")


def _check_buckets(family: CustomFamily, buckets: Sequence[float] | None) -> None:
    """A histogram's series needs strictly increasing bucket bounds; a series of any other kind takes none."""
    if family.kind == HISTOGRAM:
        if buckets is None:
            raise CustomMetricError("Bucket boundaries not found in Metric args.")
        if any(b >= a for a, b in zip(buckets[1:], buckets, strict=False)):
            raise CustomMetricError("Bucket Boundaries must be strictly sorted")
    elif buckets is not None:
        raise CustomMetricError(f"Unexpected args found in {family.kind} Metric constructor.")
