"""The server's side of one model process: what that process may ask of the server (BLS calls, whether a request
was cancelled, its custom metrics, its log records, a decoupled request's responses) and what the server holds for
it (the requests it was handed, the metric handles it opened), all let go of when the process ends."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from geserve.backends.base import InferenceHost
from geserve.backends.python.isolation.channel import Channel
from geserve.backends.python.metrics import MetricStore
from geserve.errors import GeserveError, InternalError
from geserve.metrics.custom import CustomFamily, CustomMetricError, Series
from geserve.types import InferenceRequest
from geserve.types.streams import StreamClosedError, StreamResponse

logger = logging.getLogger(__name__)


@dataclass
class MetricHandles:
    """The metric families and series one process opened in the server's store, each under the id it was given."""

    store: MetricStore
    families: dict[int, CustomFamily] = field(default_factory=dict)
    series: dict[int, tuple[CustomFamily, Series]] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def open_family(self, name: str, description: str, kind: str) -> int | str:
        try:
            family = self.store.open_family(name, description, kind)
        except CustomMetricError as exc:
            return str(exc)  # the refusal, which the process raises in the model's words
        handle = next(self._ids)
        self.families[handle] = family
        return handle

    def open_series(self, family_id: int, labels: dict[str, str], buckets: Sequence[float] | None) -> int | str:
        family = self.families[family_id]
        try:
            series = self.store.open_series(family, labels, buckets)
        except CustomMetricError as exc:
            return str(exc)
        handle = next(self._ids)
        self.series[handle] = (family, series)
        return handle

    def update(self, series_id: int, operation: str, value: float) -> None:
        _, series = self.series[series_id]
        getattr(series, operation)(value)  # checked in the process by a series of the same kind

    def value(self, series_id: int) -> float | str:
        try:
            return self.series[series_id][1].value()
        except CustomMetricError as exc:
            return str(exc)

    def release(self, family_id: int, series_id: int | None) -> None:
        if series_id is None:
            family = self.families.pop(family_id, None)
            if family is not None:
                self.store.release(family)
            return
        held = self.series.pop(series_id, None)
        if held is not None:
            self.store.release(*held)

    def release_all(self) -> None:
        """The process is gone: its series leave /metrics, as an unloaded instance's do."""
        for family, series in self.series.values():
            self.store.release(family, series)
        for family in self.families.values():
            self.store.release(family)
        self.series.clear()
        self.families.clear()


class Session:
    """Serves one process' calls on the server's loop; `hold` / `let_go` the requests it is handed."""

    def __init__(self, instance_name: str, host: InferenceHost, store: MetricStore) -> None:
        self.instance_name = instance_name
        self._host = host
        self.metrics = MetricHandles(store)
        self.held: dict[int, InferenceRequest] = {}
        self._keys = itertools.count()
        self.channel: Channel | None = None
        self.pid = 0

    def hold(self, request: InferenceRequest) -> int:
        key = next(self._keys)  # atomic: instance threads hold, the loop lets go
        self.held[key] = request
        return key

    def let_go(self, key: int) -> None:
        self.held.pop(key, None)

    async def handle(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "stream":
            self._stream(*args)
        elif method == "cancelled":
            return self._cancelled(*args)
        elif method == "infer":
            return await self._host.infer(args[0])
        elif method == "infer_stream":
            await self._infer_stream(*args)
        elif method == "log":
            self._log(*args)
        elif method.startswith("metric_"):
            return self._metric(method, args)
        else:
            raise InternalError(f"unknown call '{method}' from the process of '{self.instance_name}'")
        return None

    def _metric(self, method: str, args: tuple[Any, ...]) -> Any:
        handles = self.metrics
        if method == "metric_update":
            return handles.update(*args)
        if method == "metric_family":
            return handles.open_family(*args)
        if method == "metric_series":
            return handles.open_series(*args)
        if method == "metric_value":
            return handles.value(*args)
        if method == "metric_release":
            return handles.release(*args)
        raise InternalError(f"unknown metric call '{method}'")

    def _stream(self, key: int, item: StreamResponse) -> None:
        request = self.held.get(key)
        if request is None or request.stream is None:
            return
        if item.final:
            self.held.pop(key, None)
        with contextlib.suppress(StreamClosedError):  # ended here already (the process lost a race with an unload)
            request.stream.send(item)

    def _cancelled(self, key: int) -> bool:
        request = self.held.get(key)
        if request is None:
            return False
        return request.cancelled or (request.stream is not None and request.stream.cancelled)

    async def _infer_stream(self, key: int, request: InferenceRequest) -> None:
        """A BLS stream: each response goes to the process as it comes; failures end the call itself."""
        channel = self.channel
        assert channel is not None
        async for item in self._host.infer_stream(request):
            channel.notify("bls_item", key, item)

    def _log(self, name: str, level: int, path: str, line: int, function: str, message: str,
             exc_text: str | None) -> None:
        target = logging.getLogger(name)
        if target.isEnabledFor(level):
            record = target.makeRecord(name, level, path, line, message, (), None, function)
            record.process, record.exc_text = self.pid, exc_text
            target.handle(record)

    def end(self, error: GeserveError) -> None:
        """The process is gone: the streams it still owed end with `error`, its metric series go."""
        held, self.held = self.held, {}
        for request in held.values():
            if request.stream is not None:
                request.stream.fail(error)
        self.metrics.release_all()
