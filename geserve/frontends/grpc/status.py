"""The gRPC frontend's one table from neutral error codes to the status codes Triton answers with."""

from __future__ import annotations

import logging

import grpc

from geserve.errors import ErrorCode, GeserveError

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


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """A failed call's status and details, for every path of both transports: a GeserveError by its code, anything
    else INTERNAL (a bug: logged)."""
    if isinstance(exc, GeserveError):
        return GRPC_STATUS[exc.code], exc.message
    logger.error("grpc: unhandled error serving a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc}"
