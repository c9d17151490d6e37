"""The protocol-neutral operations every frontend calls: health, metadata, infer, repository, statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from geserve.config import message_to_json_dict
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, UnavailableError, UnsupportedError
from geserve.repository.lifecycle import ModelManager
from geserve.repository.model import LoadedModel
from geserve.service.classification import classify
from geserve.service.validation import prepare
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.streams import ResponseStream, StreamResponse
from geserve.version import __version__

SERVER_NAME = "geserve"
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


class DataPlane:
    def __init__(self, manager: ModelManager, explicit_control: bool, strict_readiness: bool) -> None:
        self._manager = manager
        self._explicit = explicit_control
        self._strict = strict_readiness
        self.accepting = True
        # Set by the server once it runs: where calls from other threads (Python models' BLS) are scheduled.
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- health and metadata ----------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.accepting and (not self._strict or self._manager.all_ready())

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS}

    async def model_ready(self, name: str, version: str = "") -> bool:
        """READY in the lifecycle, and (for models whose instances check their own readiness) ready by them."""
        try:
            model = self._manager.get(name, version)
        except GeserveError:
            return False
        return model.readiness is None or await model.readiness()

    def model(self, name: str, version: str = "") -> LoadedModel:
        return self._manager.get(name, version)

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
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

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return message_to_json_dict(self._manager.get(name, version).config)

    # ---- inference --------------------------------------------------------------------------------

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        model = self._manager.get(request.model_name, request.model_version)
        if model.decoupled:
            raise UnsupportedError(
                f"model '{model.name}' uses the decoupled transaction policy: its responses can only be streamed"
            )
        started = time.monotonic_ns()
        prepare(model, request)  # a request the model never sees is no failure of the model's (Triton's stats)
        try:
            response = await model.scheduler.enqueue(request)
            if request.outputs is not None:
                _apply_classification(model, request, response)
        except GeserveError as exc:
            model.statistics.record_failure(time.monotonic_ns() - started, exc)
            raise
        model.statistics.record_success(time.monotonic_ns() - started)
        response.model_version = str(model.version)
        return response

    async def infer_stream(self, request: InferenceRequest) -> AsyncIterator[StreamResponse]:
        """Each response of `request` as the model sends it, the last flagged final (see InferenceHost)."""
        model = self._manager.get(request.model_name, request.model_version)
        if not model.decoupled:
            yield StreamResponse(await self.infer(request), final=True)
            return
        started = time.monotonic_ns()
        prepare(model, request)
        stream = ResponseStream(asyncio.get_running_loop())
        request.stream = stream
        execution = asyncio.ensure_future(model.scheduler.enqueue(request))
        execution.add_done_callback(lambda done: _fail_unfinished(stream, done))
        version = str(model.version)
        succeeded = False
        try:
            async for item in stream:
                if item.response is not None:
                    item.response.model_version = version
                succeeded = item.error is None
                yield item
        finally:
            if not stream.final_sent:
                stream.cancelled = True  # the reader left early: the model's senders see is_cancelled()
            model.statistics.record_request(succeeded, time.monotonic_ns() - started)

    # ---- repository and statistics ----------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self._manager.index(ready_only)

    async def load_model(self, name: str, config_json: str | None = None) -> None:
        self._require_explicit("load")
        await self._manager.load(name, config_json)

    async def unload_model(self, name: str) -> None:
        self._require_explicit("unload")
        await self._manager.unload(name)

    def _require_explicit(self, action: str) -> None:
        if not self._explicit:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
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


def _fail_unfinished(stream: ResponseStream, execution: asyncio.Future) -> None:
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
