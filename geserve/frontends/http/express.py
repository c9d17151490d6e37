"""HTTP's express lane: an inference request whose JSON header the server already decoded and checked for the same
model goes straight to the model's batch queue, and is answered from the batch's completion by a callback (or, for a
model that runs it at once on the loop, straight to its instance).

Why: at c=16 with dynamic batching, routing, decoding, the service's checks and the nine coroutine frames between
the connection and the batcher cost about as much CPU as the model itself (issue 15's batched cell). A client sends
the same header bytes with every request of the same shapes (perf_analyzer, tritonclient), and for one model object
the outcome of routing, decoding and checking is a pure function of those bytes: the lane learns it from a request
the routed path served (`learn`) and replays it (`submit`, `answer_now`). It takes only what it can replay exactly:
binary fixed-size inputs, no request id or parameters, no shared memory (codec.KnownHeader), a model whose scheduler
queues without a coroutine or runs at once, with no call policy, tracer, response cache or decoupled transaction
(InferenceService.model_soon), and a plain (no TLS, no content coding) body. Anything else, and any request the lane
declines, takes the routed path, which gives the same answer. Statistics, cancellation (a client that goes away
withdraws its queued request: CANCELED) and early dispatch see lane requests as any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from geserve.errors import GeserveError
from geserve.frontends.http.answers import Answer, error_response, infer_response
from geserve.frontends.http.codec import KnownHeader, known_header
from geserve.service.service import InferenceService, ReadyModel
from geserve.types import InferenceRequest, InferenceResponse

Deliver = Callable[[Answer], None]
_MAX_PLANS = 256  # as codec's known headers: a client that never repeats a header gains nothing from keeping them


@dataclass(frozen=True, slots=True)
class _Plan:
    """How a request with these header bytes becomes its model's prepared request."""

    model: ReadyModel
    target: tuple[str, str]  # the model's name and version as the path gives them
    decode: KnownHeader
    order: tuple[int, ...] | None  # where each of the model's inputs is among the header's; None: the same order
    batch_size: int
    queues: bool  # the model's scheduler queues requests (`submit`); else it may run them at once (`answer_now`)


def infer_target(path: str) -> tuple[str, str] | None:
    """(model, version) of /v2/models/{name}[/versions/{digits}]/infer; None for any other path."""
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[3] and parts[4] == "infer":
        return parts[3], ""
    if len(parts) == 7 and parts[:3] == ["", "v2", "models"] and parts[3] and parts[4] == "versions" \
            and parts[5].isdigit() and parts[6] == "infer":
        return parts[3], parts[5]
    return None


class ExpressLane:
    """The plans learnt from served requests, and the lane's way in (`submit`) and out (`_answered`)."""

    def __init__(self, service: InferenceService, max_input_size: int) -> None:
        self._service = service
        self._max_input_size = max_input_size
        self._plans: dict[tuple[str, bytes], _Plan] = {}

    def submit(
        self, path: str, headers: dict[bytes, bytes], body: bytes, deliver: Deliver
    ) -> Callable[[], None] | None:
        """Queue the request when the lane knows its header and its model queues: `deliver` is called with its
        answer, and the returned call withdraws it. None, having done nothing, for a request the lane leaves to
        `answer_now` or to the routed path."""
        prepared = self._prepared(path, headers, body, True)
        if prepared is None:
            return None
        model, request = prepared
        return self._service.infer_soon(model, request, partial(self._answered, path, request, headers, deliver))

    def answer_now(self, path: str, headers: dict[bytes, bytes], body: bytes) -> Answer | None:
        """The answer, when the lane knows the request's header and its model runs it at once (on the loop); None,
        having done nothing, for a request the routed path must serve."""
        prepared = self._prepared(path, headers, body, False)
        if prepared is None:
            return None
        model, request = prepared
        try:
            response = self._service.infer_prepared_now(model, request)
            if response is None:
                return None
            return *infer_response(response, request, headers), None
        except Exception as exc:
            return *error_response(exc, "POST", path), None

    def _prepared(
        self, path: str, headers: dict[bytes, bytes], body: bytes, queued: bool
    ) -> tuple[ReadyModel, InferenceRequest] | None:
        """The request its plan makes of `body`, and its model; None where the lane has no plan for it, or one for a
        model that does not queue (`queued`) or does (not `queued`)."""
        length = _header_length(headers)
        if length is None or b"content-encoding" in headers or b"transfer-encoding" in headers \
                or len(body) > self._max_input_size:
            return None
        key = (path, body[:length])
        plan = self._plans.get(key)
        if plan is None or plan.queues is not queued or length + plan.decode.data_size != len(body):
            return None
        model = plan.model
        if self._service.model_soon(*plan.target) is not model:  # reloaded, unloaded, now traced, ...
            del self._plans[key]  # learnt again from the routed path's next success
            return None
        request = plan.decode.request(body, length, *plan.target)
        if plan.order is not None:
            request.inputs = [request.inputs[i] for i in plan.order]
        request.batch_size = plan.batch_size
        return model, request

    @staticmethod
    def _answered(
        path: str, request: InferenceRequest, headers: dict[bytes, bytes], deliver: Deliver,
        result: InferenceResponse | Exception,
    ) -> None:
        if isinstance(result, Exception):
            answer = error_response(result, "POST", path)
        else:
            try:
                answer = infer_response(result, request, headers)
            except Exception as exc:  # an output the encoder refuses: answered as the routed path answers it
                answer = error_response(exc, "POST", path)
        deliver((*answer, None))

    def learn(self, path: str, headers: dict[bytes, bytes], body: bytes) -> None:
        """After the routed path served `body` (its content codings undone) to `path` successfully: keep its plan if the
        lane can replay it."""
        header_length = _header_length(headers)
        if not header_length or header_length >= len(body):
            return
        header = body[:header_length]
        key = (path, header)
        if key in self._plans:  # known already (this request bypassed the queue, or the lane declined it)
            return
        target = infer_target(path)
        decode = known_header(header)
        if target is None or decode is None:
            return
        model = self._service.model_soon(*target)
        if model is None:
            return
        request = decode.request(body, header_length, *target)
        names = [t.name for t in request.inputs]
        try:
            self._service.prepare_soon(model, request)  # against this very model: the plan keeps it
        except GeserveError:
            return
        order = tuple(names.index(t.name) for t in request.inputs)
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
        self._plans[key] = _Plan(
            model, target, decode, None if order == tuple(range(len(order))) else order, request.batch_size,
            hasattr(model.scheduler, "submit"),
        )


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    """`Inference-Header-Content-Length` where it is a plain number (the routed path words every other fault)."""
    raw = headers.get(b"inference-header-content-length")
    return int(raw) if raw is not None and raw.isdigit() else None
