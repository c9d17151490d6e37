"""The gRPC frontend: a grpc.aio server on the event loop whose servicer turns each RPC into a data plane call."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from geserve.errors import GeserveError, InternalError, InvalidArgumentError, NotFoundError, UnsupportedError
from geserve.frontends.grpc import converters as convert
from geserve.frontends.grpc.health import HealthService
from geserve.frontends.grpc.status import GRPC_STATUS
from geserve.repository.model import LoadedModel
from geserve.service.dataplane import DataPlane
from geserve.service.runtime_settings import LogSettings, TraceSettings
from geserve.service.shared_memory import SharedMemoryRegistry
from geserve.service.validation import prepare
from geserve.types import InferenceResponse

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
STRICT_STREAM_HEADER = "triton_grpc_error"  # "true": the first failed request ends the stream with its status
_NO_CUDA_SHM = "CUDA shared memory is not supported by geserve; use system shared memory"
_END = object()

Message = TypeVar("Message")


@dataclass(frozen=True, slots=True)
class GrpcOptions:
    address: str = "0.0.0.0"
    port: int = 8001
    infer_allocation_pool_size: int = 8
    """Accepted for tritonserver compatibility; grpc.aio allocates per call."""
    max_message_size: int = INT32_MAX
    """Largest message sent or received, in bytes (Triton's limit: INT32_MAX)."""
    log_settings: LogSettings = field(default_factory=LogSettings)
    trace_settings: TraceSettings = field(default_factory=TraceSettings)


def _rpc(method: Callable[..., Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    """A unary RPC: a GeserveError becomes its status with its message; anything else INTERNAL, logged."""

    @functools.wraps(method)
    async def wrapper(self: GrpcInferenceServicer, request: Any, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await method(self, request, context)
        except GeserveError as exc:
            await context.abort(GRPC_STATUS[exc.code], exc.message)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            logger.exception("unhandled error serving %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
        raise AssertionError("unreachable: abort raises")

    return wrapper


class GrpcInferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane, shm: SharedMemoryRegistry, options: GrpcOptions) -> None:
        self._dataplane = dataplane
        self._shm = shm
        self._log = options.log_settings
        self._trace = options.trace_settings

    # ---- health and metadata ------------------------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._dataplane.live())

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._dataplane.ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        version = convert.from_version(request.version)
        return pb.ModelReadyResponse(ready=await self._dataplane.model_ready(request.name, version))

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return convert.to_server_metadata_response(self._dataplane.server_metadata())

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        version = convert.from_version(request.version)
        return convert.to_model_metadata_response(self._dataplane.model_metadata(request.name, version))

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        model = self._dataplane.model(request.name, convert.from_version(request.version))
        response = pb.ModelConfigResponse()
        response.config.CopyFrom(model.config)
        return response

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        version = convert.from_version(request.version)
        return convert.to_model_statistics_response(self._dataplane.statistics(request.name, version))

    # ---- inference ----------------------------------------------------------------------------------

    def _model(self, message: pb.ModelInferRequest) -> LoadedModel:
        # The model first, as Triton: an unknown one is NOT_FOUND whatever the request holds.
        return self._dataplane.model(message.model_name, convert.from_version(message.model_version))

    def _decode(self, model: LoadedModel, message: pb.ModelInferRequest) -> convert.DecodedRequest:
        decoded = convert.from_model_infer_request(message, self._shm)
        if decoded.deferred is not None:
            prepare(model, decoded.request)  # the core's checks come first in Triton's order
            raise decoded.deferred
        return decoded

    @_rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        model = self._model(request)
        if model.decoupled:
            raise UnsupportedError("ModelInfer RPC doesn't support models with decoupled transaction policy")
        decoded = self._decode(model, request)
        response = await self._dataplane.infer(decoded.request)
        return convert.to_model_infer_response(response, decoded, self._shm)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """Every request runs as soon as it arrives; responses go out as they complete, errors in-band
        (`error_message`) unless the client sent `triton_grpc_error: true`, which ends the stream instead.
        A decoupled model's responses go out one by one as it sends them, `triton_final_response` true on the
        last; its final flag sent alone becomes an empty response only if the request enabled that."""
        strict = any(k == STRICT_STREAM_HEADER and v == "true" for k, v in context.invocation_metadata() or ())
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        def fault(error: GeserveError, message: pb.ModelInferRequest) -> None:
            queue.put_nowait(error if strict else convert.to_stream_error(error, message.id))

        async def answer(message: pb.ModelInferRequest) -> None:
            try:
                model = self._model(message)
                decoded = self._decode(model, message)
                if not model.decoupled:
                    response = await self._dataplane.infer(decoded.request)
                    queue.put_nowait(convert.to_stream_response(response, decoded, self._shm))
                    return
                async for item in self._dataplane.infer_stream(decoded.request):
                    if item.error is not None:
                        fault(item.error, message)
                    elif item.response is not None:
                        queue.put_nowait(convert.to_stream_response(item.response, decoded, self._shm, item.final))
                    elif decoded.empty_final:
                        empty = InferenceResponse(model.name, str(model.version), [], decoded.request.id)
                        queue.put_nowait(convert.to_stream_response(empty, decoded, self._shm))
            except GeserveError as exc:
                fault(exc, message)
            except Exception as exc:
                logger.exception("unhandled error serving a streamed request")
                fault(InternalError(f"internal error: {exc}"), message)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    task = asyncio.create_task(answer(message))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                queue.put_nowait(_END)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, GeserveError):
                    await context.abort(GRPC_STATUS[item.code], item.message)
                await context.write(item)
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    # ---- repository ---------------------------------------------------------------------------------

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        _refuse_repository_name(request)
        return convert.to_repository_index_response(self._dataplane.repository_index(request.ready))

    @_rpc
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        _refuse_repository_name(request)
        name, config = convert.from_repository_model_load_request(request)
        await self._dataplane.load_model(name, config)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        _refuse_repository_name(request)
        await self._dataplane.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- shared memory ------------------------------------------------------------------------------

    @_rpc
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        return convert.to_system_shared_memory_status_response(self._shm.status(request.name))

    @_rpc
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self._shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self._shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> pb.CudaSharedMemoryStatusResponse:
        raise UnsupportedError(_NO_CUDA_SHM)

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> pb.CudaSharedMemoryRegisterResponse:
        raise UnsupportedError(_NO_CUDA_SHM)

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        raise UnsupportedError(_NO_CUDA_SHM)

    # ---- trace and log settings ---------------------------------------------------------------------

    @_rpc
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Any) -> pb.TraceSettingResponse:
        model = request.model_name
        if model:
            try:
                self._dataplane.model(model)
            except NotFoundError:
                raise InvalidArgumentError(f"Request for unknown model : {model}") from None
        changes = convert.from_trace_setting_request(request)
        values = self._trace.update(changes, model) if changes else self._trace.get(model)
        return convert.to_trace_setting_response(values)

    @_rpc
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Any) -> pb.LogSettingsResponse:
        changes = convert.from_log_settings_request(request)
        return convert.to_log_settings_response(self._log.update(changes) if changes else self._log.get())


class GrpcServer:
    """inference.GRPCInferenceService and grpc.health.v1.Health on one grpc.aio server, on the running loop."""

    def __init__(self, dataplane: DataPlane, shm: SharedMemoryRegistry, options: GrpcOptions) -> None:
        self._dataplane = dataplane
        self._shm = shm
        self.options = options
        self._server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        host = self.options.address
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{host}:{self.options.port}"

    async def start(self) -> None:
        size = self.options.max_message_size
        server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            ("grpc.so_reuseport", 0),  # a port already in use fails the start instead of being shared
        ])
        servicer = GrpcInferenceServicer(self._dataplane, self._shm, self.options)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((HealthService(self._dataplane.ready).handler(),))
        try:
            bound = server.add_insecure_port(self.target)
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"failed to start the GRPC service: unable to bind {self.target}")
        await server.start()
        self._server = server
        logger.info("started GRPCInferenceService at %s", self.target)

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


def _refuse_repository_name(request: Any) -> None:
    """One repository namespace here: the repository RPCs refuse a named one, as Triton does without namespacing."""
    if request.repository_name:
        raise UnsupportedError("'repository_name' specification is not supported")
