"""Tracing as the service sees it: sample a request, trace it through the model, and emit it when complete.

The service holds a `Tracing` in `InferenceService.tracer` only while some trace setting can trace a request;
otherwise that attribute is None, and an untraced server pays that one test per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from geserve.service.context import CallContext
from geserve.service.tracing.config import TraceConfig
from geserve.service.tracing.ledger import Ledger
from geserve.service.tracing.otel import OtelExporter, parse_traceparent
from geserve.service.tracing.settings import TIMESTAMPS, TraceSettings
from geserve.service.tracing.trace import Trace
from geserve.service.tracing.trace_file import TraceFile
from geserve.types import InferenceRequest, InferenceResponse

if TYPE_CHECKING:
    from geserve.repository.model import LoadedModel

Execute = Callable[["LoadedModel", InferenceRequest, int], Awaitable[InferenceResponse]]


class Tracing:
    """The trace settings and where complete traces go (`mode=triton`: the trace file; `opentelemetry`: OTLP)."""

    def __init__(self, config: TraceConfig | None = None, shared: str | None = None) -> None:
        """`shared`: in a worker of several (--workers), the file of the ledger the server's workers share
        (ledger.py): one numbering of traces, one trace file, one count of traces left."""
        config = config or TraceConfig()
        self._ledger = Ledger(shared)
        self.settings = TraceSettings(config, self._ledger)
        self._otel = OtelExporter(config) if config.mode == "opentelemetry" else None
        self._file = TraceFile(config.file, self._ledger) if config.mode == "triton" and config.file else None

    @property
    def on(self) -> bool:
        return self.settings.on

    def _sample(self, model: str, context: CallContext) -> Trace | None:
        scope = self.settings.scope(model)
        if self._otel is not None:
            remote = parse_traceparent(context.headers.get("traceparent"))
            if remote is not None and scope.level:  # a propagated context is always traced, as in Triton
                # no TENSORS in OTel mode (Triton)
                return Trace(self._emit, TIMESTAMPS, scope, remote=remote, ids=self._ledger.next_id)
        level = scope.sample()
        return Trace(self._emit, level, scope, ids=self._ledger.next_id) if level else None

    async def run(
        self, model: LoadedModel, request: InferenceRequest, context: CallContext, started_ns: int,
        execute: Execute, frontend: bool,
    ) -> InferenceResponse:
        """`execute` the request, traced when it is sampled (or is an ensemble step of a traced request). A trace
        of a request a frontend answers (`frontend`) is handed to it in `context.trace`: the frontend adds its send
        times and emits it."""
        trace = request.trace
        if not isinstance(trace, Trace):
            trace = self._sample(model.name, context)
            if trace is None:
                return await execute(model, request, started_ns)
            request.trace = trace
        trace.begin(model, request, started_ns, context.trace_marks)
        try:
            response = await execute(model, request, started_ns)
        except BaseException:
            trace.end(None)
            trace.emit()
            raise
        trace.end(response)
        if frontend:
            context.trace = trace
        else:
            trace.emit()
        return response

    def _emit(self, trace: Trace) -> None:
        if self._otel is not None:
            self._otel.export(trace)
            return
        if self._file is None:
            return
        root = trace
        while root.parent is not None:
            root = root.parent
        scope = root.scope
        self._file.add(trace, scope.log_frequency if scope is not None else 0)
        if trace.parent is None and scope is not None and scope.count == 0:
            self._file.flush()  # the last trace asked for: Triton writes what it holds now

    def close(self) -> None:
        """Write or export what is left (the server is stopping)."""
        if self._file is not None:
            self._file.close()
        if self._otel is not None:
            self._otel.close()
