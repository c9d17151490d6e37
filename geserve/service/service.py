"""The one front door: every call of every protocol, with its call context, grouped by Triton's API groups.

Frontends translate bytes and call here; everything that is not wire format happens here once: admission by
API group, model lookup, the decoupled refusal, request parameters, shared-memory placement, statistics with
failure reasons, classification, and the control APIs (repository, shared memory, trace, logging, statistics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from geserve.config import ModelConfig
from geserve.errors import (
    CancelledError,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnknownModelError,
    UnsupportedError,
)
from geserve.repository.lifecycle import ModelManager
from geserve.repository.model import LoadedModel
from geserve.service.classification import classify
from geserve.service.context import IN_PROCESS, ApiGroup, CallContext, CallPolicy, Transport
from geserve.service.parameters import apply_parameters
from geserve.service.raw_input import expand_raw_input
from geserve.service.runtime_settings import LogSettings, LogValue, TraceSettings
from geserve.service.shared_memory import OutputPlacementError, RegionStatus, SharedMemoryRegistry
from geserve.service.validation import prepare
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.streams import ResponseStream, StreamResponse
from geserve.types.wire import tensor_bytes
from geserve.version import __version__

SERVER_NAME = "geserve"
SHUTTING_DOWN = "Server is shutting down: it accepts no new requests"
# What a server that is shutting down still answers from outside: health, metadata, settings, statistics. New work
# (inference, model loads) is refused; calls from models (BLS, ensemble steps) belong to requests in flight.
_REFUSED_WHILE_DRAINING = frozenset({ApiGroup.INFERENCE, ApiGroup.MODEL_REPOSITORY})
# In Triton's order. Both frontends serve system shared memory (refused unless --allow-system-shared-memory, yet
# listed, as Triton lists it), trace and logging settings; CUDA shared memory is not claimed: no region can exist.
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]
# How Triton refuses a decoupled model on a call that can carry one response only.
_DECOUPLED_REFUSAL = {
    Transport.HTTP: "HTTP end point doesn't support models with decoupled transaction policy",
    Transport.GRPC: "ModelInfer RPC doesn't support models with decoupled transaction policy",
    Transport.IN_PROCESS: "model '{}' uses the decoupled transaction policy: its responses can only be streamed",
}


class InferenceService:
    """Every operation of the server. `policies` see each call (its API group and context) before it runs."""

    def __init__(
        self,
        manager: ModelManager,
        *,
        explicit_control: bool,
        strict_readiness: bool,
        shared_memory: SharedMemoryRegistry | None = None,
        log_settings: LogSettings | None = None,
        trace_settings: TraceSettings | None = None,
        policies: Sequence[CallPolicy] = (),
        server_name: str = SERVER_NAME,
    ) -> None:
        self._manager = manager
        self._explicit = explicit_control
        self._strict = strict_readiness
        self.shared_memory = shared_memory if shared_memory is not None else SharedMemoryRegistry(False)
        self._log = log_settings if log_settings is not None else LogSettings()
        self._trace = trace_settings if trace_settings is not None else TraceSettings()
        self.policies = list(policies)
        self.server_name = server_name
        self.accepting = True
        self._inflight = 0  # inference calls under way, of every transport
        self._idle: asyncio.Event | None = None  # set when the last one ends, once someone waits for that
        self.host = ModelHost(self)
        # Set by the server once it runs: where calls from other threads (Python models' BLS) are scheduled.
        self.loop: asyncio.AbstractEventLoop | None = None

    def admit(self, group: ApiGroup, context: CallContext) -> None:
        """Every call's first step (frontends call it themselves only for answers they give without the service,
        such as the CUDA shared memory calls no region can exist for)."""
        for policy in self.policies:
            policy.admit(group, context)
        if not self.accepting and group in _REFUSED_WHILE_DRAINING and context.transport is not Transport.IN_PROCESS:
            raise UnavailableError(SHUTTING_DOWN)

    def stop_accepting(self) -> None:
        """Readiness turns false and new inference and repository calls are refused; calls in flight go on."""
        self.accepting = False

    @property
    def inflight(self) -> int:
        return self._inflight

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no inference call is under way, at most `timeout_s`; True when none is."""
        if self._inflight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
            except asyncio.TimeoutError:  # not the builtin before 3.11
                pass
            finally:
                self._idle = None
        return not self._inflight

    def _enter(self) -> None:
        self._inflight += 1

    def _leave(self) -> None:
        self._inflight -= 1
        if not self._inflight and self._idle is not None:
            self._idle.set()

    # ---- health and metadata ----------------------------------------------------------------------

    def live(self, context: CallContext = IN_PROCESS) -> bool:
        self.admit(ApiGroup.HEALTH, context)
        return True

    def ready(self, context: CallContext = IN_PROCESS) -> bool:
        self.admit(ApiGroup.HEALTH, context)
        return self.accepting and (not self._strict or self._manager.all_ready())

    async def model_ready(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> bool:
        """READY in the lifecycle, and (for models whose instances check their own readiness) ready by them."""
        self.admit(ApiGroup.HEALTH, context)
        try:
            model = self._manager.get(name, version)
        except GeserveError:
            return False
        return model.readiness is None or await model.readiness()

    def server_metadata(self, context: CallContext = IN_PROCESS) -> dict[str, Any]:
        self.admit(ApiGroup.METADATA, context)
        return {"name": self.server_name, "version": __version__, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> dict[str, Any]:
        self.admit(ApiGroup.METADATA, context)
        model = self._manager.get(name, version)
        record = self._manager.record(name)
        versions = sorted(v for v, s in record.versions.items() if s.model is not None) if record else []
        batch = [-1] if model.max_batch_size > 0 else []
        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": model.config.platform or model.config.backend,
            "inputs": [
                {"name": s.name, "datatype": s.wire_type, "shape": batch + list(s.dims)} for s in model.inputs.values()
            ],
            "outputs": [
                {"name": s.name, "datatype": s.wire_type, "shape": batch + list(s.dims)}
                for s in model.outputs.values()
            ],
        }

    def model_config(self, name: str, version: str = "", context: CallContext = IN_PROCESS) -> ModelConfig:
        self.admit(ApiGroup.MODEL_CONFIG, context)
        return self._manager.get(name, version).config

    # ---- inference --------------------------------------------------------------------------------

    async def infer(self, request: InferenceRequest, context: CallContext = IN_PROCESS) -> InferenceResponse:
        """One request, one response; a decoupled model is refused (use `infer_stream`)."""
        self.admit(ApiGroup.INFERENCE, context)
        self._enter()
        try:
            model = self._lookup(request)
            if model.decoupled:
                raise UnsupportedError(_DECOUPLED_REFUSAL[context.transport].format(model.name))
            started = time.monotonic_ns()
            self._prepare(model, request, context)  # a request the model never sees is no failure of the model's
            response = await self._execute(model, request, started)
            self._place_outputs(request, response)
            return response
        finally:
            self._leave()

    async def infer_stream(
        self, request: InferenceRequest, context: CallContext = IN_PROCESS
    ) -> AsyncIterator[StreamResponse]:
        """Each response of `request` as the model sends it, the last flagged final: any number for a decoupled
        model, one otherwise. Faults found before the model runs are raised; later ones come as items."""
        self.admit(ApiGroup.INFERENCE, context)
        self._enter()
        try:
            model = self._lookup(request)
            started = time.monotonic_ns()
            self._prepare(model, request, context)
            if not model.decoupled:
                response = await self._execute(model, request, started)
                self._place_outputs(request, response)
                yield StreamResponse(response, final=True)
                return
            responses = self._decoupled_responses(model, request, started)
            try:
                async for item in responses:
                    yield item
            finally:
                await responses.aclose()  # at once, not when collected: its cancel and statistics are due now
        finally:
            self._leave()

    async def _decoupled_responses(
        self, model: LoadedModel, request: InferenceRequest, started: int
    ) -> AsyncGenerator[StreamResponse, None]:
        stream = ResponseStream(asyncio.get_running_loop())
        request.stream = stream
        execution = asyncio.ensure_future(model.scheduler.enqueue(request))
        execution.add_done_callback(lambda done: _fail_unfinished(stream, done))
        version = request.model_version = str(model.version)  # what a final flag sent alone is answered with
        error: GeserveError | None = None
        read_final = False
        try:
            async for item in stream:
                if item.response is not None:
                    item.response.model_version = version
                    self._place_outputs(request, item.response)
                error, read_final = item.error, item.final
                yield item
        except GeserveError as exc:  # an output its shared memory region cannot hold
            error, read_final = exc, True
            raise
        finally:
            if not read_final:
                stream.cancelled = True  # the reader left early: the model's senders see is_cancelled()
                error = CancelledError("the client stopped reading the responses")
            elapsed = time.monotonic_ns() - started
            if error is None:
                model.statistics.record_success(elapsed)
            else:
                model.statistics.record_failure(elapsed, error)

    def _lookup(self, request: InferenceRequest) -> LoadedModel:
        try:
            return self._manager.get(request.model_name, request.model_version)
        except NotFoundError as exc:
            raise UnknownModelError(exc.message) from None

    def _prepare(self, model: LoadedModel, request: InferenceRequest, context: CallContext) -> None:
        """Triton's order once the model is known: the frontend's decoding faults, the parameters, the output
        placements, then the core's checks, then the faults Triton's core finds after them."""
        if request.fault is not None:
            raise request.fault
        apply_parameters(request, context.transport)
        if request.outputs is not None:
            for output in request.outputs:
                if output.shm is not None:  # the region must hold the window now: Triton checks before inference
                    self.shared_memory.read(*output.shm)
        if request.raw_input is not None:
            expand_raw_input(model, request, request.raw_input)
        prepare(model, request)
        if request.late_fault is not None:
            raise request.late_fault

    @staticmethod
    async def _execute(model: LoadedModel, request: InferenceRequest, started: int) -> InferenceResponse:
        try:
            response = await model.scheduler.enqueue(request)
            if request.outputs is not None:
                _apply_classification(model, request, response)
        except Exception as exc:  # counted whatever failed, then answered by the frontend's error table
            model.statistics.record_failure(time.monotonic_ns() - started, exc)
            raise
        model.statistics.record_success(time.monotonic_ns() - started)
        response.model_version = str(model.version)
        return response

    def _place_outputs(self, request: InferenceRequest, response: InferenceResponse) -> None:
        """Write the outputs the client placed in shared memory into their regions."""
        if request.outputs is None:
            return
        placed = {o.name: o.shm for o in request.outputs if o.shm is not None}
        if not placed:
            return
        for output in response.outputs:
            location = placed.get(output.name)
            if location is not None:
                try:
                    self.shared_memory.write(*location, output.name, tensor_bytes(output))
                except InternalError as exc:
                    raise OutputPlacementError(exc.message) from None

    # ---- model repository -------------------------------------------------------------------------

    def repository_index(self, ready_only: bool = False, context: CallContext = IN_PROCESS) -> list[dict[str, str]]:
        self.admit(ApiGroup.MODEL_REPOSITORY, context)
        return self._manager.index(ready_only)

    async def load_model(
        self, name: str, parameters: dict[str, Any] | None = None, context: CallContext = IN_PROCESS
    ) -> None:
        """Load (or reload) `name`; the `config` parameter (JSON text) overrides its config.pbtxt."""
        self.admit(ApiGroup.MODEL_REPOSITORY, context)
        parameters = parameters or {}
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidArgumentError("the 'config' parameter of a load request must be a JSON string")
        files = sorted(k for k in parameters if k.startswith("file:"))
        if files:
            raise InvalidArgumentError(
                f"load request carries model files {files}; geserve loads model files from the repository only"
            )
        self._require_explicit()
        await self._manager.load(name, config)

    async def unload_model(self, name: str, context: CallContext = IN_PROCESS) -> None:
        self.admit(ApiGroup.MODEL_REPOSITORY, context)
        self._require_explicit()
        await self._manager.unload(name)

    def _require_explicit(self) -> None:
        if not self._explicit:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")

    # ---- statistics -------------------------------------------------------------------------------

    def statistics(self, name: str = "", version: str = "", context: CallContext = IN_PROCESS) -> dict[str, Any]:
        self.admit(ApiGroup.STATISTICS, context)
        if name:
            record = self._manager.record(name)
            models = [s.model for _, s in sorted(record.versions.items()) if s.model is not None] if record else []
            if not models:
                raise InvalidArgumentError(f"requested model '{name}' is not available")
            if version:
                models = [m for m in models if str(m.version) == version]
                if not models:
                    raise InvalidArgumentError(f"requested model version is not available for model '{name}'")
        else:
            models = sorted(self._manager.models(), key=lambda m: (m.name, m.version))
        return {"model_stats": [m.statistics.as_json(m.name, str(m.version)) for m in models]}

    # ---- shared memory ----------------------------------------------------------------------------

    def shared_memory_status(self, name: str = "", context: CallContext = IN_PROCESS) -> list[RegionStatus]:
        self.admit(ApiGroup.SHARED_MEMORY, context)
        return self.shared_memory.status(name)

    def register_shared_memory(
        self, name: str, key: str, offset: int, byte_size: int, context: CallContext = IN_PROCESS
    ) -> None:
        self.admit(ApiGroup.SHARED_MEMORY, context)
        self.shared_memory.register(name, key, offset, byte_size)

    def unregister_shared_memory(self, name: str = "", context: CallContext = IN_PROCESS) -> None:
        self.admit(ApiGroup.SHARED_MEMORY, context)
        self.shared_memory.unregister(name)

    # No GPU is used, so no CUDA region can ever be registered: Triton's answers on such a machine.

    def cuda_shared_memory_status(self, name: str = "", context: CallContext = IN_PROCESS) -> list[RegionStatus]:
        self.admit(ApiGroup.SHARED_MEMORY, context)
        if name:
            raise NotFoundError(f"Unable to find cuda shared memory region: '{name}'")
        return []

    def register_cuda_shared_memory(self, name: str, context: CallContext = IN_PROCESS) -> None:
        self.admit(ApiGroup.SHARED_MEMORY, context)
        raise InvalidArgumentError("failed to register shared memory region: invalid args")

    def unregister_cuda_shared_memory(self, name: str = "", context: CallContext = IN_PROCESS) -> None:
        """Unregistering a region that does not exist succeeds, as in Triton."""
        self.admit(ApiGroup.SHARED_MEMORY, context)

    # ---- trace and logging ------------------------------------------------------------------------

    def trace_setting(
        self, model: str = "", changes: dict[str, list[str]] | None = None, context: CallContext = IN_PROCESS
    ) -> dict[str, list[str]]:
        """The trace settings of `model` (the server's when empty), after applying `changes` if any."""
        self.admit(ApiGroup.TRACE, context)
        if model:
            try:
                self._manager.get(model)
            except NotFoundError:
                raise InvalidArgumentError(f"Request for unknown model : {model}") from None
        return self._trace.update(changes, model) if changes else self._trace.get(model)

    def log_settings(
        self, changes: dict[str, LogValue] | None = None, context: CallContext = IN_PROCESS
    ) -> dict[str, LogValue]:
        self.admit(ApiGroup.LOGGING, context)
        return self._log.update(changes) if changes else self._log.get()


class ModelHost:
    """The service as models see it (`InferenceHost`): BLS calls and ensemble steps are in-process calls."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._service.loop

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        return await self._service.infer(request, IN_PROCESS)

    def infer_stream(self, request: InferenceRequest) -> AsyncIterator[StreamResponse]:
        return self._service.infer_stream(request, IN_PROCESS)


def _fail_unfinished(stream: ResponseStream, execution: asyncio.Future[InferenceResponse]) -> None:
    """A request the scheduler failed (timeout, unload, a crashed execution) ends its stream with the error."""
    if execution.cancelled():
        stream.fail(UnavailableError("the request was cancelled before its model answered"))
        return
    error = execution.exception()
    if error is not None:
        stream.fail(error if isinstance(error, GeserveError) else InternalError(f"execution failed: {error}"))


def _apply_classification(model: LoadedModel, request: InferenceRequest, response: InferenceResponse) -> None:
    wanted = {o.name: o.classification for o in request.outputs or () if o.classification}
    if not wanted:
        return
    batching = model.max_batch_size > 0
    response.outputs = [
        classify(o, wanted[o.name], model.labels.get(o.name), batching) if o.name in wanted else o
        for o in response.outputs
    ]
