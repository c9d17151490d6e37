"""The standard grpc.health.v1.Health service (Check, Watch), its two messages built here from a descriptor.

`grpcio-health-checking` is not a dependency: two messages do not justify one. They live in a private
descriptor pool, so the real package can still be imported alongside.

Readiness is asked with each call's own context, so the health group's rules apply here as on `ServerReady`: a
restricted or protected health group refuses a caller without the header or token with the same status and words.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from geserve.errors import GeserveError
from geserve.frontends.grpc.converters import Unparsable, tolerant_parser
from geserve.frontends.grpc.status import GRPC_STATUS

SERVICE = "grpc.health.v1.Health"
INFERENCE_SERVICE = "inference.GRPCInferenceService"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3
WATCH_INTERVAL_S = 0.5


def _messages() -> tuple[type[Message], type[Message]]:
    proto = descriptor_pb2.FileDescriptorProto(name="geserve/grpc_health_v1.proto", package="grpc.health.v1",
                                               syntax="proto3")
    field = descriptor_pb2.FieldDescriptorProto
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for name, number in (("UNKNOWN", 0), ("SERVING", 1), ("NOT_SERVING", 2), ("SERVICE_UNKNOWN", 3)):
        status.value.add(name=name, number=number)
    response.field.add(name="status", number=1, type=field.TYPE_ENUM, label=field.LABEL_OPTIONAL,
                       type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _messages()


ServicerContext = grpc.aio.ServicerContext[Any, Any]


class HealthService:
    """Overall health ("") and the inference service's both follow the server's readiness, which `ready` asks the
    service for with the call's context (a GeserveError it raises is the call's status)."""

    def __init__(self, ready: Callable[[ServicerContext], bool]) -> None:
        self._ready = ready

    async def _status(self, service: str, context: ServicerContext) -> int | None:
        if service not in ("", INFERENCE_SERVICE):
            return None
        try:
            ready = self._ready(context)
        except GeserveError as exc:  # refused (restricted, token, scope): its status, as on ServerReady
            await context.abort(GRPC_STATUS[exc.code], exc.message)
            raise  # abort raised already
        return SERVING if ready else NOT_SERVING

    async def check(self, request: Any, context: ServicerContext) -> Any:
        await _refuse_unparsable(request, context)
        status = await self._status(request.service, context)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return HealthCheckResponse(status=status)

    async def watch(self, request: Any, context: ServicerContext) -> AsyncIterator[Any]:
        await _refuse_unparsable(request, context)
        last = None
        while True:
            status = await self._status(request.service, context)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)

    def handler(self) -> grpc.GenericRpcHandler:
        decode, encode = tolerant_parser(HealthCheckRequest), HealthCheckResponse.SerializeToString
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(self.check, decode, encode),
            "Watch": grpc.unary_stream_rpc_method_handler(self.watch, decode, encode),
        })


async def _refuse_unparsable(request: Any, context: ServicerContext) -> None:
    """Bytes that are not a HealthCheckRequest: INVALID_ARGUMENT, as on the inference service."""
    if type(request) is Unparsable:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error().message)
