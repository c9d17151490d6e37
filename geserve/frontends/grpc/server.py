"""The gRPC frontend: a grpc.aio server on the event loop whose servicer turns each RPC into a service call."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from geserve.errors import GeserveError, InternalError, UnsupportedError
from geserve.frontends.grpc import converters as convert
from geserve.frontends.grpc.health import HealthService
from geserve.frontends.grpc.status import GRPC_STATUS, GrpcStatus, grpc_status
from geserve.frontends.grpc.stream_order import InOrder, Outstanding
from geserve.frontends.tls import GrpcTls, TlsEndpoint, TlsFiles, grpc_peer_subject
from geserve.service.context import ApiGroup, CallContext, Transport
from geserve.service.deadlines import caller_deadline
from geserve.service.service import InferenceService
from geserve.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
STRICT_STREAM_HEADER = "triton_grpc_error"  # "true": the first failed request ends the stream with its status
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
    # Triton's keepalive flags and their defaults (gRPC core's own for a server).
    keepalive_time_ms: int = 7_200_000
    """Period of the server's keepalive pings."""
    keepalive_timeout_ms: int = 20_000
    """How long a keepalive ping may go unacknowledged before the connection is closed."""
    keepalive_permit_without_calls: bool = False
    """Allow keepalive pings on a connection with no call under way."""
    http2_max_pings_without_data: int = 2
    """Pings the server may send with no data frame between them (0: no limit); current gRPC core applies it
    to clients only, and Triton passes it all the same."""
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    """A client's pings closer together than this, with no data between, each earn a strike."""
    http2_max_ping_strikes: int = 2
    """Strikes before the server closes the connection (GOAWAY "too_many_pings"; 0: no limit)."""
    max_concurrent_streams: int = 1024
    """Most calls (HTTP/2 streams) open at once on one connection; further ones wait for one to end."""
    tls: TlsFiles | None = None
    """TLS (--grpc-use-ssl[-mutual]); None: plaintext."""
    reuse_port: bool = False
    """Share the port with the server's other worker processes (--workers); else a port in use fails the start."""

    def channel_options(self) -> list[tuple[str, int]]:
        """The grpc server's channel arguments for these options."""
        return [
            ("grpc.max_send_message_length", self.max_message_size),
            ("grpc.max_receive_message_length", self.max_message_size),
            ("grpc.so_reuseport", int(self.reuse_port)),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", self.http2_max_pings_without_data),
            # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose string keeps its older name.
            ("grpc.http2.min_ping_interval_without_data_ms", self.http2_min_recv_ping_interval_without_data_ms),
            ("grpc.http2.max_ping_strikes", self.http2_max_ping_strikes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
        ]


def _rpc(method: Callable[..., Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    """A unary RPC: a GeserveError becomes its status with its message; anything else INTERNAL, logged. A request
    whose bytes did not parse arrives as `Unparsable` and is answered INVALID_ARGUMENT."""

    @functools.wraps(method)
    async def wrapper(
        self: GrpcInferenceServicer, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Message:
        try:
            if type(request) is convert.Unparsable:
                raise request.error()
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*grpc_status(exc))
        raise AssertionError("unreachable: abort raises")

    return wrapper


# Set once a server in this process verifies client certificates (mutual TLS): only then does a call read its
# auth context (about 2 µs) for the certificate's subject; plaintext and one-way TLS calls skip it.
_verifies_clients = False


def verify_clients() -> None:
    """A server in this process verifies client certificates (mutual TLS): calls read the certificate's subject."""
    global _verifies_clients
    _verifies_clients = True


def call_context(context: grpc.aio.ServicerContext[Any, Any]) -> CallContext:
    """The service's view of an RPC: peer, metadata (lower-case keys), deadline, cancellation, and under mutual
    TLS the client certificate's subject."""
    remaining = context.time_remaining()
    return CallContext(
        Transport.GRPC,
        context.peer() or "",
        {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)},
        deadline=None if remaining is None else caller_deadline(time.monotonic(), remaining),
        is_cancelled=context.cancelled,
        peer_certificate_subject=grpc_peer_subject(context.auth_context()) if _verifies_clients else None,
    )


class GrpcInferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: InferenceService) -> None:
        self._service = service

    # ---- health and metadata ------------------------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._service.live(call_context(context)))

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._service.ready(call_context(context)))

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        version = convert.from_version(request.version)
        ready = await self._service.model_ready(request.name, version, call_context(context))
        return pb.ModelReadyResponse(ready=ready)

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return convert.to_server_metadata_response(self._service.server_metadata(call_context(context)))

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        version = convert.from_version(request.version)
        metadata = self._service.model_metadata(request.name, version, call_context(context))
        return convert.to_model_metadata_response(metadata)

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        version = convert.from_version(request.version)
        response = pb.ModelConfigResponse()
        response.config.CopyFrom(self._service.model_config(request.name, version, call_context(context)))
        return response

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Any) -> pb.ModelStatisticsResponse:
        version = convert.from_version(request.version)
        statistics = await self._service.statistics(request.name, version, call_context(context))
        return convert.to_model_statistics_response(statistics)

    # ---- inference ----------------------------------------------------------------------------------

    def _decode(self, message: pb.ModelInferRequest) -> convert.DecodedRequest:
        """A fault found while decoding is reported once the model is known (Triton looks it up first)."""
        try:
            return convert.from_model_infer_request(message, self._service.shared_memory)
        except GeserveError as exc:
            version = message.model_version if message.model_version.isdigit() else ""
            request = InferenceRequest(message.model_name, version, [], id=message.id, fault=exc)
            return convert.DecodedRequest(request)

    @_rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        """grpc.aio's ModelInfer (the native server calls `begin`): the same steps, awaited."""
        call = call_context(context)
        decoded = self._decoded(request, call)
        return self._encoded(await self._service.infer(decoded, call), decoded, call)

    def begin(
        self, message: pb.ModelInferRequest, context: Any, deliver: Callable[[Any], None]
    ) -> pb.ModelInferResponse | GrpcStatus | Callable[[], None]:
        """ModelInfer without a task (h2_connection's Begin): the response, or the status of its refusal, when the
        service answered at once; else the call that withdraws it, `deliver` getting its response or status later."""
        call = call_context(context)
        request = None
        try:
            if type(message) is convert.Unparsable:
                raise message.error()
            request = self._decoded(message, call)
            outcome = self._service.submit(request, call, functools.partial(self._delivered, deliver, request, call))
            if not isinstance(outcome, InferenceResponse):
                return outcome
            return self._encoded(outcome, request, call)
        except Exception as exc:
            return grpc_status(exc)

    def _delivered(
        self, deliver: Callable[[Any], None], request: InferenceRequest, call: CallContext,
        outcome: InferenceResponse | Exception,
    ) -> None:
        try:
            if isinstance(outcome, Exception):
                raise outcome
            deliver(self._encoded(outcome, request, call))
        except Exception as exc:
            deliver(grpc_status(exc))

    def _decoded(self, message: pb.ModelInferRequest, call: CallContext) -> InferenceRequest:
        """The request, admitted before its tensors are decoded: a caller who may not infer, or whom the model's
        admission control sheds, costs no decoding (and is admitted once). gRPC read the message before: a traced
        request's read is its decoding."""
        self._service.admit_ahead(ApiGroup.INFERENCE, call, "infer", message.model_name, message.model_version)
        if self._service.tracer is None:
            return self._decode(message).request
        read_start = time.monotonic_ns()
        request = self._decode(message).request
        call.trace_marks = [("GRPC_WAITREAD_START", read_start), ("GRPC_WAITREAD_END", time.monotonic_ns())]
        return request

    @staticmethod
    def _stream_item(
        outcome: InferenceResponse | Exception, request: InferenceRequest, message_id: str,
        failure: Callable[[GeserveError, str], Any],
    ) -> Any:
        """A non-decoupled model's one response on a stream, or its failure as the stream reports failures."""
        if isinstance(outcome, InferenceResponse):
            try:
                return convert.to_stream_response(outcome, request, True)
            except Exception as exc:  # an output the encoder refuses
                outcome = exc
        if not isinstance(outcome, GeserveError):
            logger.error("unhandled error serving a streamed request", exc_info=outcome)
            outcome = InternalError(f"internal error: {outcome}")
        return failure(outcome, message_id)

    @staticmethod
    def _encoded(response: InferenceResponse, request: InferenceRequest, call: CallContext) -> pb.ModelInferResponse:
        trace = call.trace  # set only on a request the service traced
        if trace is None:
            return convert.to_model_infer_response(response, request)
        trace.mark("GRPC_SEND_START")  # the encoding; gRPC writes the message after this returns
        message = convert.to_model_infer_response(response, request)
        trace.finish("GRPC_SEND_END")
        return message

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Every request runs as soon as it arrives; a non-decoupled model's response goes out in its request's
        place (stream_order.InOrder, as Triton's stream_infer_handler.cc), errors in-band (`error_message`) unless
        the client sent `triton_grpc_error: true`, which ends the stream instead. A decoupled model's responses go
        out one by one as it sends them, `triton_final_response` true on the last; its final flag sent alone
        becomes an empty response only if the request enabled that."""
        call = call_context(context)
        try:  # refused at its start, as Triton refuses a restricted stream; each request is still admitted
            self._service.authorize(ApiGroup.INFERENCE, call, "infer_stream")
        except GeserveError as exc:
            await context.abort(GRPC_STATUS[exc.code], exc.message)
        strict = call.headers.get(STRICT_STREAM_HEADER) == "true"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()
        write_now: Callable[[Any], bool] | None = getattr(context, "write_now", None)  # the native server's
        writing = False  # the writer below is sending a message

        def send(item: Any) -> None:
            """A response out now when nothing is ahead of it and the windows allow, else to the writer."""
            if write_now is None or writing or not queue.empty() or not write_now(item):
                queue.put_nowait(item)

        def out(item: Any) -> None:
            if isinstance(item, GeserveError):
                queue.put_nowait(item)  # strict: the writer ends the stream with it
            else:
                send(item)

        def failure(error: GeserveError, request_id: str) -> Any:
            return error if strict else convert.to_stream_error(error, request_id)

        order = InOrder(out)

        outstanding = Outstanding()

        def settled(
            turn: int, message_id: str, request: InferenceRequest, outcome: InferenceResponse | Exception
        ) -> None:
            outstanding.settled(turn)
            order.done(turn, [self._stream_item(outcome, request, message_id, failure)])

        def start(message: pb.ModelInferRequest) -> bool:
            """A non-decoupled model's request, started as it is read (`submit`, without a task): its one response
            takes its request's turn. False, having done nothing, for a decoupled model's (Triton asks the model's
            transaction policy as it reads the request: an unknown model's error keeps its place too)."""
            if type(message) is convert.Unparsable or self._service.decoupled(message.model_name,
                                                                             message.model_version):
                return False  # an unparsable message is answered as the stream reads it
            turn = order.turn()
            request = InferenceRequest(message.model_name, "", [])
            outcome: InferenceResponse | Callable[[], None] | Exception
            try:
                request = self._decode(message).request
                outcome = self._service.submit(
                    request, call, functools.partial(settled, turn, message.id, request), "infer_stream"
                )
            except Exception as exc:
                outcome = exc
            if callable(outcome) and not isinstance(outcome, InferenceResponse):
                outstanding.add(turn, outcome)
            else:
                order.done(turn, [self._stream_item(outcome, request, message.id, failure)])
            return True

        async def answer(message: pb.ModelInferRequest, emit: Callable[[Any], None]) -> None:
            decoded = self._decode(message)
            request = decoded.request
            try:
                async for item in self._service.infer_stream(request, call):
                    if item.error is not None:
                        emit(failure(item.error, message.id))
                    elif item.response is not None:
                        emit(convert.to_stream_response(item.response, request, item.final))
                    elif decoded.empty_final:
                        empty = InferenceResponse(request.model_name, request.model_version, [], request.id)
                        emit(convert.to_stream_response(empty, request))
            except GeserveError as exc:
                emit(failure(exc, message.id))
            except Exception as exc:
                logger.exception("unhandled error serving a streamed request")
                emit(failure(InternalError(f"internal error: {exc}"), message.id))

        answer_messages_now = getattr(context, "answer_messages_now", None)  # the native server's, as they arrive
        if answer_messages_now is not None:
            answer_messages_now(start)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if type(message) is convert.Unparsable:  # answered like any refused request; the stream goes on
                        order.now(failure(message.error(), ""))
                        continue
                    if start(message):
                        continue
                    task = asyncio.create_task(answer(message, out))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                await outstanding.wait()
            finally:
                outstanding.withdraw()
                queue.put_nowait(_END)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, GeserveError):
                    await context.abort(GRPC_STATUS[item.code], item.message)
                writing = True
                try:
                    await context.write(item)
                finally:
                    writing = False
        finally:
            # The call is over (the client cancelled it, or it ended): the requests still under way are cancelled,
            # so queued ones leave their schedulers (counted CANCELED) instead of running for nobody.
            if answer_messages_now is not None:
                answer_messages_now(None)
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    # ---- repository ---------------------------------------------------------------------------------

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Any) -> pb.RepositoryIndexResponse:
        _refuse_repository_name(request)
        index = self._service.repository_index(request.ready, call_context(context))
        return convert.to_repository_index_response(index)

    @_rpc
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        _refuse_repository_name(request)
        name, parameters = convert.from_repository_model_load_request(request)
        await self._service.load_model(name, parameters, call_context(context))
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        _refuse_repository_name(request)
        await self._service.unload_model(request.model_name, call_context(context))
        return pb.RepositoryModelUnloadResponse()

    # ---- shared memory ------------------------------------------------------------------------------

    @_rpc
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = self._service.shared_memory_status(request.name, call_context(context))
        return convert.to_system_shared_memory_status_response(regions)

    @_rpc
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        await self._service.register_shared_memory(
            request.name, request.key, request.offset, request.byte_size, call_context(context)
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._service.unregister_shared_memory(request.name, call_context(context))
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Any
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = self._service.cuda_shared_memory_status(request.name, call_context(context))
        return convert.to_cuda_shared_memory_status_response(regions)

    @_rpc
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Any
    ) -> pb.CudaSharedMemoryRegisterResponse:
        await self._service.register_cuda_shared_memory(
            request.name, request.raw_handle, request.device_id, request.byte_size, call_context(context)
        )
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Any
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._service.unregister_cuda_shared_memory(request.name, call_context(context))
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- trace and log settings ---------------------------------------------------------------------

    @_rpc
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Any) -> pb.TraceSettingResponse:
        changes = convert.from_trace_setting_request(request)
        values = await self._service.trace_setting(request.model_name, changes, call_context(context))
        return convert.to_trace_setting_response(values)

    @_rpc
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Any) -> pb.LogSettingsResponse:
        changes = convert.from_log_settings_request(request)
        return convert.to_log_settings_response(await self._service.log_settings(changes, call_context(context)))


class GrpcServer(TlsEndpoint):
    """inference.GRPCInferenceService and grpc.health.v1.Health on one grpc.aio server, on the running loop."""

    _tls: GrpcTls | None

    name = "grpc"
    reports_arrivals = False  # grpc.aio shows no connections; a client may open a stream at any time

    def __init__(self, service: InferenceService, options: GrpcOptions) -> None:
        self._service = service
        self.options = options
        self._server: grpc.aio.Server | None = None
        self._tls = GrpcTls(options.tls) if options.tls is not None else None

    @property
    def target(self) -> str:
        return grpc_target(self.options.address, self.options.port)

    async def start(self) -> None:
        server = grpc.aio.server(options=self.options.channel_options())
        servicer = GrpcInferenceServicer(self._service)
        server.add_generic_rpc_handlers((inference_handler(servicer),))
        health = HealthService(lambda context: self._service.ready(call_context(context)))
        server.add_generic_rpc_handlers((health.handler(),))
        try:
            if self._tls is None:
                bound = server.add_insecure_port(self.target)
            else:
                bound = server.add_secure_port(self.target, self._tls.credentials)
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"failed to start the GRPC service: unable to bind {self.target}")
        await server.start()
        self._server = server
        if self._tls is not None and self._tls.files.mutual:
            verify_clients()
        logger.info("started GRPCInferenceService at %s%s", self.target, _tls_note(self._tls))

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


def grpc_target(address: str, port: int) -> str:
    """host:port as gRPC names a listening address (an IPv6 host in brackets)."""
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"{host}:{port}"


def _tls_note(tls: GrpcTls | None) -> str:
    return "" if tls is None else " (TLS, mutual)" if tls.files.mutual else " (TLS)"


def inference_handler(servicer: GrpcInferenceServicer) -> grpc.GenericRpcHandler:
    """Every RPC of inference.GRPCInferenceService, from service_pb2's descriptor, as the generated
    `add_GRPCInferenceServiceServicer_to_server` registers them but with tolerant request parsers: bytes that are
    not the request message reach the servicer as `Unparsable` (answered INVALID_ARGUMENT) instead of failing
    inside grpc.aio, which would answer UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        parse = convert.tolerant_parser(getattr(pb, method.input_type.name))
        encode = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, parse, encode)
        elif not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(behaviour, parse, encode)
        else:  # the protocol has no such RPC today; one added later must be wired here knowingly
            raise NotImplementedError(f"{method.full_name}: unsupported streaming shape")
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _refuse_repository_name(request: Any) -> None:
    """One repository namespace here: the repository RPCs refuse a named one, as Triton does without namespacing."""
    if request.repository_name:
        raise UnsupportedError("'repository_name' specification is not supported")
