"""Triton's custom metrics for Python models (`pb_utils.MetricFamily` and its `Metric`s), in the server's store.

Model code builds families with no handle on the server: they find it through the MetricScope each instance binds
to the threads running its code, and closes on unload. Threads a model starts itself have none; for them alone, a
module-level default scope (the last Python backend's store: one server per process) is the practical way in.
"""

from __future__ import annotations

import contextlib
import enum
import json
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from geserve.backends.python.messages import TritonModelException
from geserve.metrics.custom import COUNTER, GAUGE, HISTOGRAM, CustomFamily, CustomMetricError, CustomMetricStore, Series

_T = TypeVar("_T")
_DELETED = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The 'MetricFamily' object "
    "should be deleted AFTER its corresponding 'Metric' objects have been deleted."
)


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __str__(self) -> str:  # as Triton's (pybind) enum prints
        return f"MetricKind.{self.name}"


_KINDS = {MetricKind.COUNTER: COUNTER, MetricKind.GAUGE: GAUGE, MetricKind.HISTOGRAM: HISTOGRAM}


class MetricStore(Protocol):
    """Where families and series live: the server's CustomMetricStore, or, in a model's own process, a stand-in that
    asks the server's (isolation/remote.py). Refusals are CustomMetricError."""

    def open_family(self, name: str, description: str, kind: str) -> CustomFamily: ...

    def open_series(
        self, family: CustomFamily, labels: Mapping[str, str], buckets: Sequence[float] | None = None
    ) -> Series: ...

    def release(self, family: CustomFamily, series: Series | None = None) -> None: ...


class MetricScope:
    """The custom metrics one model instance creates: closing the scope (unload) deletes its families, so
    their series leave /metrics, and later calls on them fail as on a deleted family."""

    def __init__(self, store: MetricStore, instance_name: str) -> None:
        self.store = store
        self.instance_name = instance_name
        # Weak: a family the model lets go of is deleted then (its `__del__`), as under Triton.
        self._families: weakref.WeakSet[MetricFamily] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.closed = False

    def refusal(self, error: CustomMetricError) -> str:
        """A store refusal in the words Triton's Python backend passes its core's on."""
        return f"Failed to process the request for model '{self.instance_name}', message: {error}"

    def adopt(self, family: MetricFamily) -> None:
        with self._lock:
            if self.closed:
                raise TritonModelException(
                    f"Error when creating MetricFamily: the model instance '{self.instance_name}' has been unloaded"
                )
            self._families.add(family)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            families = list(self._families)
        for family in families:
            family._delete()


_local = threading.local()
_default = MetricScope(CustomMetricStore(), "")  # model code run with no server (a unit test) still works


def set_default_store(store: MetricStore) -> None:
    global _default
    _default = MetricScope(store, "")


def bind_thread(scope: MetricScope) -> None:
    """Families created on this thread from now on belong to `scope`."""
    _local.scope = scope


@contextlib.contextmanager
def bound(scope: MetricScope) -> Iterator[MetricScope]:
    """`scope` for the duration of the block (a model file's import), the previous binding after."""
    previous = getattr(_local, "scope", None)
    _local.scope = scope
    try:
        yield scope
    finally:
        _local.scope = previous


_TEXT = (str, bytes, bytearray)  # float() would parse them; pybind's float argument refuses them


def _double(value: Any, method: str) -> float:
    """What pybind's `float` argument takes: floats, ints, bools, numpy scalars; never str or None."""
    if type(value) is float:
        return value
    if value is not None and not isinstance(value, _TEXT):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    raise TypeError(
        f"{method}(): incompatible function arguments. The following argument types are supported:\n"
        f"    1. (self: Metric, arg0: float) -> {'float' if method == 'value' else 'None'}\n\n"
        f"Invoked with: {value!r}"
    )


class Metric:
    """One series of a family (`family.Metric(labels=...)`); families with the same labels share it."""

    __slots__ = ("_scope", "_series")

    def __init__(self, series: Series, scope: MetricScope) -> None:
        self._series: Series | None = series
        self._scope = scope

    def increment(self, value: float) -> None:
        amount = _double(value, "increment")
        self._apply("increment", lambda series: series.increment(amount))

    def set(self, value: float) -> None:
        number = _double(value, "set")
        self._apply("set", lambda series: series.set(number))

    def observe(self, value: float) -> None:
        number = _double(value, "observe")
        self._apply("observe", lambda series: series.observe(number))

    def value(self) -> float:
        return self._apply("get", lambda series: series.value())

    def _apply(self, verb: str, operation: Callable[[Series], _T]) -> _T:
        """`operation` on the series, its refusals (or a deleted family) raised in Triton's words for `verb`."""
        series = self._series
        if series is None:
            raise TritonModelException(f"Failed to {verb} metric value: {_DELETED}")
        try:
            return operation(series)
        except CustomMetricError as exc:
            raise TritonModelException(f"Failed to {verb} metric value: {self._scope.refusal(exc)}") from None


_Metric = Metric  # for annotations inside MetricFamily, whose method of that name hides the class


class MetricFamily:
    """`pb_utils.MetricFamily(name=..., description=..., kind=pb_utils.MetricFamily.COUNTER)`.

    Its metrics live as long as it does (deleting a Metric object alone keeps the series, as in Triton); the
    family is deleted, with its series, when the object goes or the model instance unloads.
    """

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        if not isinstance(name, str) or not isinstance(description, str) or not isinstance(kind, MetricKind):
            raise TypeError(
                "__init__(): incompatible constructor arguments. The following argument types are supported:\n"
                "    1. MetricFamily(name: str, description: str, kind: MetricKind)\n\n"
                f"Invoked with: name={name!r}, description={description!r}, kind={kind!r}"
            )
        scope = getattr(_local, "scope", None) or _default
        try:
            family = scope.store.open_family(name, description, _KINDS[kind])
        except CustomMetricError as exc:
            raise TritonModelException(f"Error when creating MetricFamily: {scope.refusal(exc)}") from None
        self._family: CustomFamily | None = family
        self._scope = scope
        self._metrics: list[Metric] = []
        self._lock = threading.Lock()
        try:
            scope.adopt(self)
        except TritonModelException:
            self._delete()
            raise

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> _Metric:
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        family = self._family
        # Triton sends the labels to its core as JSON: keys become strings (1 -> "1"), values must be strings.
        decoded = json.loads(json.dumps(labels)) or {}
        bounds = _bounds(family, buckets)
        if family is None:
            raise TritonModelException(f"Error when creating Metric: {_DELETED}")
        if any(not isinstance(v, str) for v in decoded.values()):
            error = CustomMetricError("attempt to access JSON non-string as string")
            raise TritonModelException(f"Error when creating Metric: {self._scope.refusal(error)}")
        try:
            series = self._scope.store.open_series(family, decoded, bounds)
        except CustomMetricError as exc:
            raise TritonModelException(f"Error when creating Metric: {self._scope.refusal(exc)}") from None
        metric = Metric(series, self._scope)
        with self._lock:
            self._metrics.append(metric)
        return metric

    def _delete(self) -> None:
        """Release every series this family handed out, then the family; its metrics fail from now on."""
        lock = getattr(self, "_lock", None)  # absent when __init__ failed early
        if lock is None:
            return
        with lock:
            family, self._family = self._family, None
            metrics, self._metrics = self._metrics, []
        if family is None:
            return
        store = self._scope.store
        for metric in metrics:
            series, metric._series = metric._series, None
            if series is not None:
                store.release(family, series)
        store.release(family)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the store may be half torn down
            self._delete()


def _bounds(family: CustomFamily | None, buckets: list[float] | None) -> list[float] | None:
    """A metric's histogram bucket bounds: given for a histogram (and only for one), checked as Triton does."""
    if buckets is None:
        if family is not None and family.kind == HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        return None
    if not isinstance(buckets, list):
        raise TritonModelException("Failed to create metric. Buckets must be a list.")
    if family is not None and family.kind != HISTOGRAM:
        raise TritonModelException("Failed to create metric. Unexpected buckets found.")
    return [_bucket(b) for b in buckets]


def _bucket(value: Any) -> float:
    try:
        if isinstance(value, _TEXT) or value is None:
            raise TypeError
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise RuntimeError(
            f"Unable to cast Python instance of type {type(value)} to C++ type 'std::vector<double>'"
        ) from None
