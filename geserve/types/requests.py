"""Protocol-neutral inference requests: what a frontend decodes and every layer below reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from geserve.errors import DeadlineExceededError, GeserveError, QueueTimeoutError
from geserve.types.streams import ResponseStream
from geserve.types.tensors import InputTensor, RequestedOutput

# The request parameters that name a request's place in a sequence (Triton's sequence batcher): they change from one
# request to the next of a sequence.
SEQUENCE_PARAMETERS = frozenset(("sequence_id", "sequence_start", "sequence_end"))


def expiry(request: InferenceRequest, now: float) -> GeserveError | None:
    """Why `request` may no longer start at `now` (service/deadlines.py), or None: its deadline passed, or it waited
    past its queue timeout. Schedulers never start a request with one."""
    deadline = request.deadline
    if deadline is not None and deadline <= now:
        return DeadlineExceededError()
    queued = request.queue_deadline
    if queued is not None and queued <= now:
        return QueueTimeoutError()
    return None


def id_prefix(request_id: str) -> str:
    """Triton's prefix of a request's error messages: `[request id: <id>] `."""
    return f"[request id: {request_id or '<id_unknown>'}] "


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the service's prepare step made of a request, to apply to the next one with the same header: its
    inputs' order (where each of the model's inputs is among the header's; None: the same) and batch size."""

    model: object
    order: tuple[int, ...] | None
    batch_size: int


@dataclass(slots=True)
class ComputeTimes:
    """Compute time of executions, in Triton's three phases (ns)."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    def add(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.input_ns += input_ns
        self.infer_ns += infer_ns
        self.output_ns += output_ns

    def add_times(self, other: ComputeTimes) -> None:
        self.add(other.input_ns, other.infer_ns, other.output_ns)


class RequestTrace(Protocol):
    """One traced request's trace, as the layers below the service see it (service/tracing/trace.py): a sink for the
    times they already take. Set on `InferenceRequest.trace` only for a request the service chose to trace, so an
    untraced request costs the scheduler one attribute test."""

    def executed(
        self,
        queue_start_ns: int,
        compute_start_ns: int,
        compute_end_ns: int,
        compute: ComputeTimes,
        batch: Sequence[InferenceRequest],
    ) -> None:
        """The execution this request ran in (monotonic ns): when it was queued, the compute span and its three
        phases, and the requests that shared the batch."""

    def child(self) -> RequestTrace:
        """A trace for a request made on this one's behalf (an ensemble step), traced whatever the sampling."""


@dataclass(slots=True)
class InferenceRequest:
    model_name: str
    model_version: str  # "" picks the model's latest ready version
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None  # None: every output of the model
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0
    # Set by the service (service/deadlines.py), on time.monotonic()'s clock; None: none. `deadline`: when the caller
    # stops waiting for the answer (grpc-timeout; an ensemble's step is made with its ensemble's). `queue_deadline`:
    # Triton's queue timeout (the `timeout` parameter, the queue policy's default), until the request starts; the
    # instance pool clears it then, and the request runs to its end as in Triton.
    deadline: float | None = None
    queue_deadline: float | None = None
    # Set by the service once validated: rows this request contributes to a batch (1 without batching).
    batch_size: int = 1
    # Set by the service for a request that waited for its model's load on demand: that wait, counted in its queue
    # time by the instance pool.
    waited_ns: int = 0
    # Set on an ensemble's step requests: the compute of each batch this request runs in is added here, so the
    # ensemble reports the compute of its steps, as Triton's does.
    compute: ComputeTimes | None = None
    # Set by the service for a decoupled model: where the backend sends each response as the model produces it.
    stream: ResponseStream | None = None
    # Set by a frontend. `fault`: what it could not decode, reported once the model is resolved (Triton looks
    # the model up first); `late_fault`: a fault Triton finds in its core, reported after the core's checks.
    fault: GeserveError | None = None
    late_fault: GeserveError | None = None
    # Triton's raw binary HTTP request: the body is the model's single input, its shape deduced by the service.
    raw_input: bytes | None = None
    # Set by the service from the call context: who made the request (a bearer token's subject, or the client
    # certificate's subject under mutual TLS); None when nothing authenticated the caller. Python models read it
    # as `request.identity()`; it is never taken from the request itself, so a client cannot claim one.
    identity: str | None = None
    # Set by the service when the call awaiting this request is cancelled (a gRPC client cancelled, an HTTP client
    # disconnected, an ensemble's request was cancelled): a request still queued leaves its scheduler, and a model
    # already running it can poll this (a Python model's `request.is_cancelled()`) to stop early. Read from model
    # threads without a lock: it only ever turns True.
    cancelled: bool = False
    # Set by the service on a request it traces (--trace-config, the trace settings); an ensemble's steps get a child
    # of their ensemble's. The scheduler reports the execution the request ran in there.
    trace: RequestTrace | None = None
    # A remembered header makes the service's prepare step a memo: `checked_by` is set by the service to the model
    # (its loaded object) it prepared this request for; a frontend that makes a request from the header of one so
    # prepared sets `prepared`, and the service then only applies it, for that same model object (a reload is a new
    # object, and prepares again).
    checked_by: object | None = None
    prepared: Prepared | None = None
