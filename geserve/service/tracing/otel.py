"""`mode=opentelemetry`: each complete trace becomes spans exported over OTLP/HTTP (needs the `otel` extra).

Spans, as Triton makes them plus a queue span: a top-level `InferRequest` span for a request from a frontend (its
HTTP / gRPC timestamps as events), under it the model's span (named after the model; REQUEST_START, QUEUE_START,
REQUEST_END), and under that `queue` (QUEUE_START to COMPUTE_START) and `compute` (COMPUTE_START to COMPUTE_END,
the input and output phases as events). An ensemble step's model span is a child of its ensemble's. A request that
ran in a batch with other traced requests links its compute span to theirs: one execution, several spans.

The spans are built once the trace is complete, from the times it recorded, as `ReadableSpan`s with ids drawn when
the trace began (a batch's links need its peers' ids before any of them is exported), and handed to the SDK's
batch span processor, which exports them with `OTLPSpanExporter`. Times move from the monotonic clock to the wall
clock by one offset taken at start.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from geserve.service.tracing.config import TraceConfig
from geserve.service.tracing.trace import RemoteParent, Trace

_FRONTEND_MARKS = frozenset({
    "HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END",
    "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END",
})
_MODEL_MARKS = frozenset({"REQUEST_START", "QUEUE_START", "INFER_RESPONSE_COMPLETE", "REQUEST_END"})


class OtelUnavailable(RuntimeError):
    """mode=opentelemetry without the SDK and its OTLP/HTTP exporter installed."""


def parse_traceparent(value: str | None) -> RemoteParent | None:
    """A W3C `traceparent` header (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`), None when malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return RemoteParent(trace_id, span_id, bool(flags & 1))


class OtelExporter:
    def __init__(self, config: TraceConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError as exc:
            raise OtelUnavailable(
                "--trace-config mode=opentelemetry needs the OpenTelemetry SDK: pip install 'geserve[otel]'"
            ) from exc
        from geserve.version import __version__

        self._resource = Resource.create({"service.name": "geserve", **config.resource})
        self._scope = InstrumentationScope("geserve", __version__)
        self._processor: Any = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.url),
            max_queue_size=config.bsp_max_queue_size,
            schedule_delay_millis=config.bsp_schedule_delay,
            max_export_batch_size=config.bsp_max_export_batch_size,
        )
        self._wall_offset = time.time_ns() - time.monotonic_ns()

    def export(self, trace: Trace) -> None:
        for span in self._spans(trace):
            self._processor.on_end(span)

    def close(self) -> None:
        self._processor.shutdown()  # exports what is queued

    def _spans(self, trace: Trace) -> list[Any]:
        spans = _Spans(trace, self._resource, self._scope, self._wall_offset)
        marks = trace.marks
        times = dict(marks)
        start, end = times.get("REQUEST_START", marks[0][1]), times.get("REQUEST_END", marks[-1][1])
        model_parent = spans.request(start, end)
        attributes = {"triton.model_name": trace.model_name, "triton.model_version": trace.model_version,
                      "triton.trace_id": trace.id, "triton.request_id": trace.request_id}
        if trace.parent is not None:
            attributes["triton.parent_id"] = trace.parent.id
        spans.add(trace.model_name, trace.span_id, model_parent, start, end,
                  [m for m in marks if m[0] in _MODEL_MARKS], attributes)
        spans.phases(times)
        return spans.made


class _Spans:
    """The spans of one trace, as the SDK's `ReadableSpan`s, in the order they are made."""

    def __init__(self, trace: Trace, resource: Any, scope: Any, wall_offset: int) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk.trace import Event, ReadableSpan

        self._api, self._event, self._readable = api, Event, ReadableSpan
        self._trace, self._resource, self._scope, self._wall = trace, resource, scope, wall_offset
        self._flags = api.TraceFlags(api.TraceFlags.SAMPLED)
        self.made: list[Any] = []

    def context(self, span_id: int, trace_id: int | None = None, remote: bool = False) -> Any:
        trace_id = self._trace.trace_id if trace_id is None else trace_id
        return self._api.SpanContext(trace_id, span_id, remote, self._flags)

    def add(self, name: str, span_id: int, parent: Any, start: int, end: int, events: list[tuple[str, int]],
            attributes: Mapping[str, Any] | None = None, links: tuple[Any, ...] = (), kind: Any = None) -> None:
        wall = self._wall
        self.made.append(self._readable(
            name, self.context(span_id), parent, self._resource, dict(attributes or {}),
            [self._event(n, {}, ns + wall) for n, ns in events], links,
            self._api.SpanKind.INTERNAL if kind is None else kind,
            start_time=start + wall, end_time=end + wall, instrumentation_scope=self._scope,
        ))

    def request(self, start: int, end: int) -> Any:
        """The top-level span of a request from a frontend (receive to send), under the caller's remote span if
        any; the model span's parent: that span, the ensemble's model span for a step, else the remote one."""
        trace = self._trace
        if trace.parent is not None:
            return self.context(trace.parent.span_id)
        remote = trace.remote
        parent = None if remote is None else self.context(remote.span_id, remote.trace_id, remote=True)
        frontend = [m for m in trace.marks if m[0] in _FRONTEND_MARKS]
        if not frontend:
            return parent
        first, last = min(ns for _, ns in frontend), max(ns for _, ns in frontend)
        self.add("InferRequest", trace.request_span_id, parent, min(first, start), max(last, end), frontend,
                 kind=self._api.SpanKind.SERVER)
        return self.context(trace.request_span_id)

    def phases(self, times: dict[str, int]) -> None:
        """`queue` and `compute` under the model span, as far as the trace saw them."""
        trace = self._trace
        model_context = self.context(trace.span_id)
        queued, compute_start, compute_end = times.get("QUEUE_START"), times.get("COMPUTE_START"), times.get(
            "COMPUTE_END")
        if queued is not None and compute_start is not None:
            self.add("queue", _derived(trace.span_id, 1), model_context, queued, compute_start, [])
        if compute_start is not None and compute_end is not None:
            phases = [m for m in trace.marks if m[0] in ("COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START")]
            links = tuple(self._api.Link(self.context(_derived(p.span_id, 2), p.trace_id),
                                         {"geserve.shared_execution": True}) for p in trace.peers)
            self.add("compute", _derived(trace.span_id, 2), model_context, compute_start, compute_end, phases,
                     {"geserve.batch_requests": len(trace.peers) + 1}, links)


def _derived(span_id: int, salt: int) -> int:
    """The id of a span under the model's span (queue 1, compute 2): a function of it, so peers can link to it."""
    return ((span_id * 0x9E3779B97F4A7C15) + salt) & 0xFFFFFFFFFFFFFFFF or salt
