"""The gRPC frontend's one table from neutral error codes to the status codes Triton answers with, and the one place a
failed call's status (code, details, trailers) is made."""

from __future__ import annotations

import logging
from typing import NamedTuple

import grpc

from geserve.errors import ErrorCode, GeserveError, OverloadedError

logger = logging.getLogger(__name__)

GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GrpcStatus(NamedTuple):
    """A call's status as both transports end it; unpacked, the arguments of grpc.aio's `context.abort`."""

    code: grpc.StatusCode
    details: str
    trailers: tuple[tuple[str, str], ...] = ()


def grpc_status(exc: Exception) -> GrpcStatus:
    """A failed call's status, for every path of both transports: a GeserveError by its code, anything else INTERNAL
    (a bug: logged). A refusal under overload carries `grpc-retry-pushback-ms`, gRPC's Retry-After: a client whose
    retry policy reads it waits that long before trying again."""
    if isinstance(exc, OverloadedError):
        return GrpcStatus(GRPC_STATUS[exc.code], exc.message, (("grpc-retry-pushback-ms", str(exc.retry_after_ms)),))
    if isinstance(exc, GeserveError):
        return GrpcStatus(GRPC_STATUS[exc.code], exc.message)
    logger.error("grpc: unhandled error serving a call", exc_info=exc)
    return GrpcStatus(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
