"""Inside a Python model's own process: the server's parts a model reaches, as stand-ins that ask the server.

The model's code runs unchanged on the backend's own PythonInstance; what it reaches of the server goes through
the channel: BLS calls (RemoteHost), `request.is_cancelled()` (asked each time, as Triton's stub asks its parent),
a decoupled model's response senders (RemoteStream), custom metrics (RemoteMetricStore: families and series live
in the server's store, updates go as notices) and pb_utils.Logger (ForwardingHandler).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from geserve.backends.python.isolation.channel import Channel
from geserve.errors import GeserveError, InternalError
from geserve.metrics.custom import (
    COUNTER,
    GAUGE,
    CounterSeries,
    CustomFamily,
    CustomMetricError,
    GaugeSeries,
    HistogramSeries,
    LabelKey,
    Series,
)
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.streams import ResponseStream, StreamClosedError, StreamResponse

ASK_TIMEOUT_S = 30.0  # a question to the server (is it cancelled, a metric's value) that takes longer: it is gone

# What crosses for a request handed to execute(): its key (the server holds the request under it), what a model reads
# of it, and whether the model answers it through a stream (decoupled).
RequestFields = tuple[int, str, str, list[Any], list[Any] | None, str, dict[str, Any], int, float | None, str | None,
                      bool]


def request_fields(key: int, request: InferenceRequest) -> RequestFields:
    return (key, request.model_name, request.model_version, request.inputs, request.outputs, request.id,
            request.parameters, request.timeout_us, request.deadline, request.identity, request.stream is not None)


class RemoteRequest(InferenceRequest):
    """A request the server holds, as the model's process sees it: `cancelled` asks the server."""

    __slots__ = ("_channel", "_gone", "key")
    key: int
    _channel: Channel
    _gone: bool

    @classmethod
    def adopt(cls, fields: RequestFields, channel: Channel) -> RemoteRequest:
        key, model, version, inputs, outputs, request_id, parameters, timeout_us, deadline, identity, streamed = fields
        request = cls(model, version, inputs, outputs, request_id, parameters, timeout_us=timeout_us,
                      deadline=deadline, identity=identity)
        request.key, request._channel, request._gone = key, channel, False
        if streamed:
            request.stream = RemoteStream(request, channel)
        return request

    @property  # a field of the request, a question here
    def cancelled(self) -> bool:
        if not self._gone:
            try:
                self._gone = bool(self._channel.call_threadsafe("cancelled", self.key).result(ASK_TIMEOUT_S))
            except (GeserveError, TimeoutError):
                self._gone = True  # the server is gone, and the client with it
        return self._gone

    @cancelled.setter
    def cancelled(self, value: bool) -> None:  # the dataclass' __init__ sets it
        if hasattr(self, "_gone"):
            self._gone = self._gone or value

    @property
    def known_cancelled(self) -> bool:
        return getattr(self, "_gone", False)


class RemoteStream(ResponseStream):
    """A decoupled request's responses, each sent to the server as it is made; ordered as the model sends them."""

    def __init__(self, request: RemoteRequest, channel: Channel) -> None:  # not the base one: no queue, no loop here
        self._request = request
        self._channel = channel
        self._lock = threading.Lock()
        self._final_sent = False

    @property  # an attribute of a stream there, the request's answer here
    def cancelled(self) -> bool:  # type: ignore[override]
        return self._request.known_cancelled  # the request's own question asks about the stream too

    def send(self, item: StreamResponse) -> None:
        with self._lock:
            if self._final_sent:
                raise StreamClosedError("the final response of this request was already sent")
            self._final_sent = item.final
            # Written before send() returns, as Triton's stub hands a response over before returning: a response
            # sent just before the process crashes still reaches the client. Under the lock: in send order.
            self._channel.notify_written("stream", self._request.key, item)


class RemoteHost:
    """The server as BLS calls from this process reach it (backends/base.InferenceHost)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._streams: dict[int, asyncio.Queue[StreamResponse]] = {}
        self._keys = itertools.count()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._channel.loop

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        response: InferenceResponse = await self._channel.call("infer", request)
        return response

    async def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[StreamResponse, None]:
        key = next(self._keys)
        items: asyncio.Queue[StreamResponse] = asyncio.Queue()
        self._streams[key] = items
        call = asyncio.ensure_future(self._channel.call("infer_stream", key, request))
        call.add_done_callback(lambda done: _end_on_failure(done, items))
        try:
            while True:
                item = await items.get()
                yield item
                if item.final:
                    return
        finally:
            self._streams.pop(key, None)

    def stream_item(self, key: int, item: StreamResponse) -> None:
        """One response of a BLS stream, from the server."""
        items = self._streams.get(key)
        if items is not None:
            items.put_nowait(item)


def _end_on_failure(call: asyncio.Future[Any], items: asyncio.Queue[StreamResponse]) -> None:
    """A BLS stream whose call failed (the model was not found, the server is gone) ends with that error."""
    if call.cancelled():
        return
    error = call.exception()
    if error is not None:
        failure = error if isinstance(error, GeserveError) else InternalError(f"BLS stream failed: {error}")
        items.put_nowait(StreamResponse(None, failure, final=True))


# ---- custom metrics ---------------------------------------------------------------------------------------------

class RemoteFamily(CustomFamily):
    __slots__ = ("remote_id",)
    remote_id: int


class RemoteSeries(Series):
    """A series of the server's store: checked here by a local series of its kind (the same refusals, at once),
    then applied there."""

    __slots__ = ("_channel", "_local", "remote_id")

    def __init__(self, local: Series, remote_id: int, channel: Channel) -> None:
        super().__init__(local.labels)
        self._local, self.remote_id, self._channel = local, remote_id, channel

    def increment(self, amount: float) -> None:
        self._local.increment(amount)
        self._channel.notify_threadsafe("metric_update", self.remote_id, "increment", amount)

    def set(self, value: float) -> None:
        self._local.set(value)
        self._channel.notify_threadsafe("metric_update", self.remote_id, "set", value)

    def observe(self, value: float) -> None:
        self._local.observe(value)
        self._channel.notify_threadsafe("metric_update", self.remote_id, "observe", value)

    def value(self) -> float:
        self._local.value()  # a histogram refuses here
        return float(_answer(self._channel, "metric_value", self.remote_id))


def _answer(channel: Channel, method: str, *args: Any) -> Any:
    """The server's answer to a metric call; a string is its store's refusal."""
    answer = channel.call_threadsafe(method, *args).result(ASK_TIMEOUT_S)
    if isinstance(answer, str):
        raise CustomMetricError(answer)
    return answer


class RemoteMetricStore:
    """The server's custom metric store, reached from this process (backends/python/metrics.MetricStore)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def open_family(self, name: str, description: str, kind: str) -> CustomFamily:
        remote_id = _answer(self._channel, "metric_family", name, description, kind)
        family = RemoteFamily(name, description, kind)
        family.remote_id = remote_id
        return family

    def open_series(
        self, family: CustomFamily, labels: Mapping[str, str], buckets: Sequence[float] | None = None
    ) -> Series:
        assert isinstance(family, RemoteFamily)
        remote_id = _answer(self._channel, "metric_series", family.remote_id, dict(labels), buckets)
        key: LabelKey = tuple(sorted(labels.items()))
        local = (CounterSeries(key) if family.kind == COUNTER else GaugeSeries(key) if family.kind == GAUGE
                 else HistogramSeries(key, buckets or ()))
        return RemoteSeries(local, remote_id, self._channel)

    def release(self, family: CustomFamily, series: Series | None = None) -> None:
        assert isinstance(family, RemoteFamily)
        series_id = series.remote_id if isinstance(series, RemoteSeries) else None
        self._channel.notify_threadsafe("metric_release", family.remote_id, series_id)


# ---- logs -------------------------------------------------------------------------------------------------------

class ForwardingHandler(logging.Handler):
    """Every record logged in this process goes to the server's log, with the model file and line it came from."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc_text = logging.Formatter().formatException(record.exc_info) if record.exc_info else None
            self._channel.notify_written("log", record.name, record.levelno, record.pathname, record.lineno,
                                            record.funcName, record.getMessage(), exc_text)
        except Exception:
            self.handleError(record)
