"""One traced request: the timestamps and tensors it collects, in Triton's names, until it is emitted.

Times are `time.monotonic_ns()` (Triton's trace file uses its steady clock the same way); the OpenTelemetry
exporter moves them onto the wall clock. A trace is emitted once: when its request ends, or for a request from
a frontend once that frontend has sent the response (HTTP_SEND_END / GRPC_SEND_END).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from geserve.service.tracing.settings import TENSORS, Scope
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse, Tensor

if TYPE_CHECKING:
    from geserve.repository.model import LoadedModel

_ids = itertools.count(1).__next__  # a trace's id when no ledger numbers them (service/tracing/ledger.py)


class RemoteParent:
    """A W3C trace context that came with the request (`traceparent`): the trace continues it."""

    __slots__ = ("sampled", "span_id", "trace_id")

    def __init__(self, trace_id: int, span_id: int, sampled: bool) -> None:
        self.trace_id, self.span_id, self.sampled = trace_id, span_id, sampled


class Trace:
    """The trace of one request (`InferenceRequest.trace`); `emit` receives it once it is complete."""

    __slots__ = (
        "_emit", "_ids", "compute", "id", "level", "marks", "model_name", "model_version", "parent", "peers", "remote",
        "request_id", "request_span_id", "scope", "span_id", "tensors", "trace_id",
    )

    def __init__(
        self, emit: Callable[[Trace], None], level: int, scope: Scope | None,
        parent: Trace | None = None, remote: RemoteParent | None = None, ids: Callable[[], int] = _ids,
    ) -> None:
        """`ids`: where the trace's id comes from (the server's ledger, which numbers its traces from 1)."""
        self._emit = emit
        self._ids = ids
        self.id = ids()
        self.level = level
        self.scope = scope  # the settings that sampled it (None for an ensemble step: its parent's were)
        self.parent = parent
        self.remote = remote
        self.model_name = ""
        self.model_version = 0
        self.request_id = ""
        self.marks: list[tuple[str, int]] = []  # (Triton's timestamp name, monotonic ns), in the order taken
        self.tensors: list[tuple[str, Tensor]] = []  # (TENSOR_QUEUE_INPUT | TENSOR_BACKEND_OUTPUT, tensor)
        self.compute: ComputeTimes | None = None
        self.peers: list[Trace] = []  # the traced requests that shared this one's execution
        # OpenTelemetry ids, drawn up front so a batch's spans can link to each other before any is exported
        self.trace_id: int
        if parent is not None:
            self.trace_id = parent.trace_id
        elif remote is not None:
            self.trace_id = remote.trace_id
        else:
            self.trace_id = random.getrandbits(128) or 1
        self.request_span_id = random.getrandbits(64) or 1  # the top-level span (a request from a frontend)
        self.span_id = random.getrandbits(64) or 1  # the model's span

    def child(self) -> Trace:
        return Trace(self._emit, self.level, None, parent=self, ids=self._ids)

    def begin(
        self, model: LoadedModel, request: InferenceRequest, started_ns: int, marks: list[tuple[str, int]] | None
    ) -> None:
        self.model_name, self.model_version, self.request_id = model.name, model.version, request.id
        if marks:
            self.marks.extend(marks)  # the frontend's HTTP_RECV_* / GRPC_WAITREAD_*
        self.marks.append(("REQUEST_START", started_ns))
        if model.config.platform == "ensemble":  # its steps queue, not the ensemble itself (Triton marks it so)
            self.marks.append(("QUEUE_START", time.monotonic_ns()))
        if self.level & TENSORS:
            self.tensors.extend(("TENSOR_QUEUE_INPUT", tensor) for tensor in request.inputs)

    def executed(
        self,
        queue_start_ns: int,
        compute_start_ns: int,
        compute_end_ns: int,
        compute: ComputeTimes,
        batch: Sequence[InferenceRequest],
    ) -> None:
        input_end = min(compute_start_ns + compute.input_ns, compute_end_ns)
        output_start = max(compute_end_ns - compute.output_ns, input_end)
        self.marks += [
            ("QUEUE_START", queue_start_ns), ("COMPUTE_START", compute_start_ns), ("COMPUTE_INPUT_END", input_end),
            ("COMPUTE_OUTPUT_START", output_start), ("COMPUTE_END", compute_end_ns),
        ]
        self.compute = compute
        if len(batch) > 1:
            self.peers = [r.trace for r in batch if isinstance(r.trace, Trace) and r.trace is not self]

    def end(self, response: InferenceResponse | None) -> None:
        """The request's end; `response` None when it failed."""
        if response is not None:
            self.marks.append(("INFER_RESPONSE_COMPLETE", time.monotonic_ns()))
            if self.level & TENSORS:
                self.tensors.extend(("TENSOR_BACKEND_OUTPUT", tensor) for tensor in response.outputs)
        self.marks.append(("REQUEST_END", time.monotonic_ns()))

    # ---- what a frontend adds (service/context.py FrontendTrace) --------------------------------------------------

    def mark(self, name: str) -> None:
        self.marks.append((name, time.monotonic_ns()))

    def finish(self, name: str) -> None:
        """The frontend's last timestamp: the trace is complete."""
        self.marks.append((name, time.monotonic_ns()))
        self._emit(self)

    def emit(self) -> None:
        self._emit(self)

    def time_of(self, name: str) -> int | None:
        for mark, ns in self.marks:
            if mark == name:
                return ns
        return None
