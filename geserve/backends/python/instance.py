"""One Python-model instance: its own TritonPythonModel object, executing batches on the pool's worker thread.

`execute` gets the batch's requests one by one, un-merged, as Triton hands them. A sync `execute` runs on the
worker thread; an `async def execute` runs on the instance's own event loop (a thread of its own, started on
first use, which keeps running between batches so tasks the model starts go on). Decoupled models answer
through response senders into each request's ResponseStream; the pool sees an empty placeholder per request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from geserve.backends.base import Execution, InferenceHost, ModelInstance
from geserve.backends.python import loader, metrics, runtime
from geserve.backends.python.messages import (
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    TritonModelException,
)
from geserve.devices import compute_priority
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.types import InferenceRequest as CoreRequest
from geserve.types import InferenceResponse as CoreResponse
from geserve.types.streams import ResponseStream, StreamClosedError, StreamResponse

logger = logging.getLogger(__name__)

Result = CoreResponse | GeserveError


class _LoopThread:
    """An event loop running forever on a thread of its own, for a model's coroutines."""

    def __init__(self, name: str, host: InferenceHost, scope: metrics.MetricScope) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(host, scope), name=f"py-{name}-loop", daemon=True)
        self._thread.start()

    def _run(self, host: InferenceHost, scope: metrics.MetricScope) -> None:
        compute_priority.lower_this_thread()  # the model's coroutines compute: below the server's event loop
        runtime.bind_thread(host)
        metrics.bind_thread(scope)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class PythonInstance(ModelInstance):
    inline_allowed = False  # execute may block on BLS calls served by the event loop: never run it there

    def __init__(
        self,
        name: str,
        module: types.ModuleType,
        host: InferenceHost,
        output_names: list[str],
        decoupled: bool,
        scope: metrics.MetricScope,
    ) -> None:
        self.name = name
        self._module = module
        self._host = host
        self._metrics = scope  # the custom metric families this instance creates
        self._output_names = output_names
        self._decoupled = decoupled
        self._loop_thread: _LoopThread | None = None
        self.model: Any = None
        # Streams of requests this instance took; those still open at finalize() are ended with an error.
        self._streams: weakref.WeakSet[ResponseStream] = weakref.WeakSet()

    # ---- life cycle ---------------------------------------------------------------------------------

    def initialize(self, args: dict[str, str]) -> None:
        """Create the model object and run its `initialize(args)`; raise UnavailableError naming the fault."""
        self._bind()
        try:
            self.model = self._module.TritonPythonModel()
            if hasattr(self.model, "initialize"):
                self._await(self.model.initialize(args))
            if not callable(getattr(self.model, "execute", None)):
                raise AttributeError("TritonPythonModel has no execute() method")
        except BaseException as exc:
            self._stop_loop()
            self._metrics.close()
            raise InternalError(
                f"failed to initialize Python model instance '{self.name}': {loader.describe(exc)}"
            ) from None

    @property
    def checks_readiness(self) -> bool:
        """The model defines `is_ready()`: the model's readiness asks it (Triton's instance-ready hook)."""
        return callable(getattr(self.model, "is_ready", None))

    def is_ready(self) -> bool:
        """The model's own `is_ready()` (sync or async); one that raises counts as not ready."""
        check = getattr(self.model, "is_ready", None)
        if not callable(check):
            return self.model is not None
        self._bind()
        try:
            return bool(self._await(check()))
        except Exception:
            logger.exception("is_ready() of Python model instance '%s' failed; reporting not ready", self.name)
            return False

    def finalize(self) -> None:
        self._bind()
        try:
            if self.model is not None and hasattr(self.model, "finalize"):
                self._await(self.model.finalize())
        except Exception:
            logger.exception("finalize() of Python model instance '%s' failed", self.name)
        finally:
            self.model = None
            self._stop_loop()
            self._metrics.close()  # as the instance goes, its families leave /metrics
            loader.forget(self._module)
            for stream in list(self._streams):
                stream.fail(UnavailableError(
                    f"the Python model instance '{self.name}' was unloaded before it sent its final response"
                ))

    # ---- execution ----------------------------------------------------------------------------------

    def execute(self, requests: list[CoreRequest]) -> Execution:
        started = time.monotonic_ns()
        return Execution.timed(self._results(requests), started)

    def _results(self, requests: list[CoreRequest]) -> list[Result]:
        self._bind()
        if self._decoupled:
            return self._execute_decoupled(requests)
        sent: list[list[tuple[InferenceResponse | None, bool]]] = [[] for _ in requests]
        wrapped = [
            InferenceRequest._incoming(request, self._output_names, self._collector(sent[index]))
            for index, request in enumerate(requests)
        ]
        try:
            returned = self._await(self.model.execute(wrapped))
        except BaseException as exc:
            return [self._failed(loader.describe(exc))] * len(requests)
        if returned is None:  # the model answered through response senders
            return [self._collected(request, responses) for request, responses in zip(requests, sent, strict=True)]
        return self._returned(requests, returned)

    def _returned(self, requests: list[CoreRequest], returned: Any) -> list[Result]:
        """The results of the responses `execute` returned, one per request."""
        returned = list(returned) if isinstance(returned, list | tuple) else returned
        if not isinstance(returned, list) or len(returned) != len(requests):
            count = len(returned) if isinstance(returned, list) else type(returned).__name__
            error = self._failed(
                "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{len(requests)}, and InferenceResponse(s) size is:{count}\n"
            )
            return [error] * len(requests)
        return [self._to_core(response, request) for response, request in zip(returned, requests, strict=True)]

    def _execute_decoupled(self, requests: list[CoreRequest]) -> list[Result]:
        streams: list[ResponseStream] = []
        for request in requests:
            if request.stream is None:
                refused = InternalError(
                    f"model '{request.model_name}' is decoupled: its requests need a response stream"
                )
                return [refused] * len(requests)
            streams.append(request.stream)
            self._streams.add(request.stream)
        wrapped = [
            InferenceRequest._incoming(request, self._output_names, self._stream_sender(request, stream), True)
            for request, stream in zip(requests, streams, strict=True)
        ]
        error: GeserveError | None = None
        try:
            returned = self._await(self.model.execute(wrapped))
            if returned is not None:
                error = self._failed(
                    f"Python model '{self.name}' is using the decoupled mode and the execute function must return "
                    "None."
                )
        except BaseException as exc:
            error = self._failed(loader.describe(exc))
        if error is not None:
            for stream in streams:
                stream.fail(error)  # the requests the model had not finished
        return [CoreResponse(r.model_name, r.model_version, [], r.id) for r in requests]

    def _bind(self) -> None:
        """The calling thread runs this instance's code: BLS calls go to its server, metrics to its scope."""
        runtime.bind_thread(self._host)
        metrics.bind_thread(self._metrics)

    def _failed(self, message: str) -> InternalError:
        """A batch that failed as a whole, in Triton's words."""
        return InternalError(f"Failed to process the request(s) for model '{self.name}', message: {message}")

    def _await(self, value: Any) -> Any:
        """A coroutine runs to its end on the instance's loop; anything else is already the result."""
        if not inspect.isawaitable(value):
            return value
        if self._loop_thread is None:
            self._loop_thread = _LoopThread(self.name, self._host, self._metrics)
        return self._loop_thread.run(value)  # type: ignore[arg-type]

    def _stop_loop(self) -> None:
        if self._loop_thread is not None:
            self._loop_thread.stop()
            self._loop_thread = None

    # ---- responses ----------------------------------------------------------------------------------

    def _to_core(self, response: Any, request: CoreRequest) -> Result:
        if not isinstance(response, InferenceResponse):
            return InternalError(
                "Expected an 'InferenceResponse' object in the execute function return list, found type "
                f"'{type(response).__name__}'."
            )
        if response.has_error():
            return response.error()._to_geserve()  # type: ignore[union-attr]
        try:
            outputs = [tensor._to_core() for tensor in response.output_tensors()]
        except Exception as exc:
            return InternalError(f"model instance '{self.name}' returned an output it cannot send: {exc}")
        if request.outputs is not None:
            wanted = {o.name for o in request.outputs}
            outputs = [o for o in outputs if o.name in wanted]
        return CoreResponse(request.model_name, request.model_version, outputs, request.id,
                            response._parameters or {})

    def _collector(self, sent: list[tuple[InferenceResponse | None, bool]]) -> Callable[[], InferenceResponseSender]:
        """Response senders of a model that is not decoupled: what they send is read once execute returns."""
        return lambda: InferenceResponseSender(
            lambda response, final: sent.append((response, final)), lambda: None, lambda: False
        )

    def _collected(self, request: CoreRequest, sent: list[tuple[InferenceResponse | None, bool]]) -> Result:
        responses = [response for response, _ in sent if response is not None]
        final = bool(sent) and sent[-1][1]
        if len(responses) != 1 or not final:
            return InternalError(
                f"model instance '{self.name}' is not decoupled: execute() returned None, so each request needs "
                f"exactly one response sent with TRITONSERVER_RESPONSE_COMPLETE_FINAL; request "
                f"'{request.id}' got {len(responses)} response(s)" + ("" if final else " and no final flag")
            )
        return self._to_core(responses[0], request)

    def _stream_sender(self, request: CoreRequest, stream: ResponseStream) -> Callable[[], InferenceResponseSender]:
        def deliver(response: InferenceResponse | None, final: bool) -> None:
            if response is None:
                item = StreamResponse(None, None, final)
            else:
                result = self._to_core(response, request)
                item = (StreamResponse(None, result, final) if isinstance(result, GeserveError)
                        else StreamResponse(result, None, final))
            try:
                stream.send(item)
            except StreamClosedError:
                raise TritonModelException("Unable to send response. Response sender has been closed.") from None

        def abandon() -> None:
            stream.fail(InternalError(
                f"the Python model '{self.name}' let go of request '{request.id or '<id_unknown>'}' (and its "
                "response sender) without sending TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            ))

        return lambda: InferenceResponseSender(deliver, abandon, lambda: stream.cancelled)
