"""The request / response side of the Triton Python API: errors, InferenceRequest (incoming and BLS),
InferenceResponse and the response sender of decoupled models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from geserve import errors
from geserve.backends.python import runtime
from geserve.backends.python.tensor import Tensor
from geserve.types import InferenceRequest as CoreRequest
from geserve.types import InferenceResponse as CoreResponse
from geserve.types import RequestedOutput
from geserve.types.requests import SEQUENCE_PARAMETERS
from geserve.types.streams import StreamResponse

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2


class TritonModelException(Exception):
    """What the API raises for misuse; a model may raise it too (it fails the batch like any exception)."""

    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class TritonError(Exception):
    """An error a model puts in a response (`InferenceResponse(error=...)`), or a BLS call gives back."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"

    # ---- geserve side ---------------------------------------------------------------------------------

    def _to_geserve(self) -> errors.GeserveError:
        return _ERROR_CLASSES.get(self._code, errors.InternalError)(self._message)

    @classmethod
    def _from_geserve(cls, error: errors.GeserveError) -> TritonError:
        return cls(error.message, _CODES.get(error.code, cls.INTERNAL))


_ERROR_CLASSES: dict[int, type[errors.GeserveError]] = {
    TritonError.INTERNAL: errors.InternalError,
    TritonError.NOT_FOUND: errors.NotFoundError,
    TritonError.INVALID_ARG: errors.InvalidArgumentError,
    TritonError.UNAVAILABLE: errors.UnavailableError,
    TritonError.UNSUPPORTED: errors.UnsupportedError,
    TritonError.ALREADY_EXISTS: errors.AlreadyExistsError,
    TritonError.CANCELLED: errors.CancelledError,
}
_CODES = {cls.code: code for code, cls in _ERROR_CLASSES.items()}
# A BLS request whose caller's deadline passed: pb_utils.TritonError has no DEADLINE_EXCEEDED, and Triton answers a
# timed-out request UNAVAILABLE.
_CODES[errors.ErrorCode.DEADLINE_EXCEEDED] = TritonError.UNAVAILABLE


class PreferredMemory:
    """Accepted for BLS compatibility; outputs always come back in CPU memory here."""

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceResponse:
    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _parameters_dict(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    # ---- geserve side ---------------------------------------------------------------------------------

    @classmethod
    def _from_core(cls, response: CoreResponse) -> InferenceResponse:
        return cls([Tensor._from_core(t) for t in response.outputs], parameters=response.parameters or None)

    @classmethod
    def _from_stream(cls, item: StreamResponse) -> InferenceResponse:
        if item.error is not None:
            return cls(error=TritonError._from_geserve(item.error))
        return cls() if item.response is None else cls._from_core(item.response)


class InferenceResponseSender:
    """Sends the responses of one request (any number for a decoupled model); the final flag closes it.

    A sender dropped without its final flag (garbage-collected: nothing can send on it any more) ends its
    request with an error, so a stream never waits forever on a response that cannot come.
    """

    def __init__(
        self,
        deliver: Callable[[InferenceResponse | None, bool], None],
        abandon: Callable[[], None],
        cancelled: Callable[[], bool],
    ) -> None:
        self._deliver = deliver
        self._abandon = abandon
        self._cancelled = cancelled
        self._closed = False
        self._request: CoreRequest | None = None  # the request it answers, whose client may have gone away

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("Inference Response object must be provided when the response flags is "
                                       "set to zero.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"send() expects an InferenceResponse, got {type(response).__name__}")
        if final:
            self._closed = True
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """Triton's: True once the request's client went away (cancelled, disconnected, stopped reading)."""
        request = self._request
        return (request is not None and request.cancelled) or self._cancelled()

    def _close(self) -> None:
        self._closed = True

    def __del__(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):  # at interpreter shutdown nothing is left to tell
                self._abandon()


class InferenceRequest:
    """A request a model receives in `execute`, or one it builds to call another model (BLS)."""

    def __init__(
        self,
        model_name: str = "",
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        correlation_id: int | str = 0,
        request_id: str = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._requested = list(requested_output_names or [])
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._parameters = _parameters_dict(parameters)
        self._sender: InferenceResponseSender | None = None
        self._make_sender: Callable[[], InferenceResponseSender] | None = None
        self._identity: str | None = None
        self._core: CoreRequest | None = None  # the server's request behind one given to execute()

    # ---- what a model reads -------------------------------------------------------------------------

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def get_input_tensor_by_name(self, name: str) -> Tensor | None:
        for tensor in self._inputs:
            if tensor.name() == name:
                return tensor
        return None

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def deadline(self) -> float | None:
        """geserve's own: the seconds left before the caller stops waiting for this request's answer (its gRPC
        deadline, a gateway's HTTP deadline, its ensemble's), negative once passed; None without one. A model may
        stop early or answer less well instead of being answered DEADLINE_EXCEEDED. (`timeout` is Triton's queue
        timeout: once `execute` has the request it no longer applies.)"""
        core = self._core
        deadline = core.deadline if core is not None else None
        return None if deadline is None else deadline - time.monotonic()

    def is_cancelled(self) -> bool:
        """Triton's: True once the request's client went away (a gRPC cancel, an HTTP disconnect, a stream's reader
        that left), so that a long `execute` can stop early; always False for a request a model builds (BLS)."""
        core = self._core
        if core is not None and core.cancelled:
            return True
        return self._sender.is_cancelled() if self._sender is not None else False

    def identity(self) -> str | None:
        """geserve's own: who sent the request, as the server verified it (a bearer token's `sub`, or the client
        certificate's subject under mutual TLS); None when nothing authenticated the caller (auth off, a BLS
        request). Not a request parameter: a client cannot set it."""
        return self._identity

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            if self._make_sender is None:
                raise TritonModelException("only a request given to execute() has a response sender")
            self._sender = self._make_sender()
            self._sender._request = self._core
        return self._sender

    # ---- BLS ----------------------------------------------------------------------------------------

    def exec(self, decoupled: bool = False) -> InferenceResponse | Iterator[InferenceResponse]:
        """Run this request on its model and wait; errors come back in the response, not raised."""
        if decoupled:
            return self._sync_stream()
        try:
            response = runtime.infer(self._to_core()).result()
        except errors.GeserveError as exc:
            return InferenceResponse(error=TritonError._from_geserve(exc))
        return InferenceResponse._from_core(response)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse | AsyncIterator[InferenceResponse]:
        """`exec` for `async def execute`: awaits without blocking the instance's own loop."""
        if decoupled:
            return self._async_stream(asyncio.get_running_loop())
        try:
            response = await asyncio.wrap_future(runtime.infer(self._to_core()))
        except errors.GeserveError as exc:
            return InferenceResponse(error=TritonError._from_geserve(exc))
        return InferenceResponse._from_core(response)

    def _sync_stream(self) -> Iterator[InferenceResponse]:
        items: queue.SimpleQueue[StreamResponse] = queue.SimpleQueue()
        self._start_stream(items.put)
        return _drain(items.get)

    def _async_stream(self, loop: asyncio.AbstractEventLoop) -> AsyncIterator[InferenceResponse]:
        items: asyncio.Queue[StreamResponse] = asyncio.Queue()
        self._start_stream(lambda item: loop.call_soon_threadsafe(items.put_nowait, item))
        return _async_drain(items)

    def _start_stream(self, emit: Callable[[StreamResponse], object]) -> None:
        try:
            runtime.stream(self._to_core(), emit)
        except errors.GeserveError as exc:
            emit(StreamResponse(None, exc, final=True))

    def _to_core(self) -> CoreRequest:
        for tensor in self._inputs:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(f"BLS inputs must be pb_utils.Tensor objects, got {type(tensor).__name__}")
        version = str(self._model_version) if isinstance(self._model_version, int) and self._model_version > 0 else ""
        parameters = dict(self._parameters)
        if self._correlation_id:  # a BLS request in a sequence travels as Triton's sequence parameters
            parameters["sequence_id"] = self._correlation_id
            parameters["sequence_start"] = bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            parameters["sequence_end"] = bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        return CoreRequest(
            self._model_name,
            version,
            [t._to_core() for t in self._inputs],
            outputs=[RequestedOutput(n) for n in self._requested] or None,
            id=self._request_id,
            parameters=parameters,
            timeout_us=int(self._timeout or 0),
        )

    # ---- geserve side: the request handed to execute() ------------------------------------------------

    @classmethod
    def _incoming(
        cls,
        request: CoreRequest,
        output_names: list[str],
        make_sender: Callable[[], InferenceResponseSender],
        decoupled: bool = False,
    ) -> InferenceRequest:
        wrapped = InferenceRequest.__new__(_DecoupledRequest if decoupled else cls)
        wrapped._model_name = request.model_name
        wrapped._inputs = [Tensor._from_core(t) for t in request.inputs]
        wrapped._requested = output_names if request.outputs is None else [o.name for o in request.outputs]
        parameters = request.parameters
        if SEQUENCE_PARAMETERS.isdisjoint(parameters):
            wrapped._correlation_id, wrapped._flags, wrapped._parameters = 0, 0, parameters
        else:
            wrapped._correlation_id, wrapped._flags, wrapped._parameters = _sequence_split(parameters)
        wrapped._request_id = request.id
        wrapped._model_version = int(request.model_version) if request.model_version.isdigit() else -1
        wrapped._timeout = request.timeout_us
        wrapped._sender = None
        wrapped._make_sender = make_sender
        wrapped._identity = request.identity
        wrapped._core = request
        return wrapped


class _DecoupledRequest(InferenceRequest):
    """A decoupled model's request: dropped without ever taking its sender, it still ends its stream."""

    def __del__(self) -> None:
        if self._sender is None and self._make_sender is not None:
            with contextlib.suppress(Exception):
                self._make_sender()  # unreferenced at once: its own __del__ reports the missing final flag


def _drain(get: Callable[[], StreamResponse]) -> Iterator[InferenceResponse]:
    while True:
        item = get()
        yield InferenceResponse._from_stream(item)
        if item.final:
            return


async def _async_drain(items: asyncio.Queue[StreamResponse]) -> AsyncIterator[InferenceResponse]:
    while True:
        item = await items.get()
        yield InferenceResponse._from_stream(item)
        if item.final:
            return




def _sequence_split(parameters: dict[str, Any]) -> tuple[int | str, int, dict[str, Any]]:
    """A request's correlation id, its sequence flags and its other parameters: Triton's frontends take the sequence
    parameters as the request's correlation id and flags, never as parameters the model sees."""
    flags = (TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if parameters.get("sequence_start") else 0) | (
        TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if parameters.get("sequence_end") else 0
    )
    rest = {k: v for k, v in parameters.items() if k not in SEQUENCE_PARAMETERS}
    return _correlation_id(parameters.get("sequence_id", 0)), flags, rest


def _correlation_id(value: Any) -> int | str:
    """`request.correlation_id()`: Triton's unsigned id (gRPC's int64 read as the same bits), or a string id."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value % (1 << 64)
    return 0


def _parameters_dict(parameters: dict[str, Any] | str | None) -> dict[str, Any]:
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        parsed = json.loads(parameters) if parameters else {}
        if not isinstance(parsed, dict):
            raise TritonModelException("parameters must be a JSON object")
        return parsed
    return dict(parameters)
