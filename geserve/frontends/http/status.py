"""The HTTP frontend's one table from neutral error codes to the statuses Triton answers with."""

from __future__ import annotations

from geserve.errors import ErrorCode

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,  # sic: Triton's HTTP answer for a region registered twice
    ErrorCode.INTERNAL: 500,
    ErrorCode.CANCELLED: 500,
    ErrorCode.UNAUTHENTICATED: 401,  # the error carries `WWW-Authenticate: Bearer ...` (RFC 6750)
    ErrorCode.PERMISSION_DENIED: 403,  # Triton's answer for a restricted API called without its header
    ErrorCode.DEADLINE_EXCEEDED: 504,  # a gateway's deadline (x-envoy-expected-rq-timeout-ms): Triton has none
}
