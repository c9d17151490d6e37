"""One error hierarchy for the whole server: neutral codes that each frontend maps to its own statuses."""

from __future__ import annotations

import enum
from collections.abc import Sequence


class ErrorCode(enum.Enum):
    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no credentials, or ones that do not verify (HTTP 401)
    PERMISSION_DENIED = "PERMISSION_DENIED"  # verified credentials that do not grant the call (HTTP 403)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the call's deadline passed before its answer (service/deadlines.py)


class GeserveError(Exception):
    """Base of every error the server reports to a client; `code` picks the status a frontend answers."""

    code: ErrorCode = ErrorCode.INTERNAL
    # Response headers the answer carries where the protocol has them (HTTP), as (name, value): an
    # authentication refusal's `WWW-Authenticate`. A class default, so subclasses that skip __init__ have it too.
    headers: tuple[tuple[str, str], ...] = ()

    def __init__(
        self, message: str, failure_reason: str | None = None, *, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.message = message
        # The `reason` label this failure is counted under (Triton's REJECTED, CANCELED, BACKEND, OTHER) when
        # it is not the one its code implies: an ensemble counts its steps' failures as OTHER, as Triton does.
        self.failure_reason = failure_reason
        if headers:
            self.headers = tuple(headers)


class InvalidArgumentError(GeserveError):
    code = ErrorCode.INVALID_ARG


class NotFoundError(GeserveError):
    code = ErrorCode.NOT_FOUND


class UnavailableError(GeserveError):
    code = ErrorCode.UNAVAILABLE


class UnsupportedError(GeserveError):
    code = ErrorCode.UNSUPPORTED


class AlreadyExistsError(GeserveError):
    code = ErrorCode.ALREADY_EXISTS


class InternalError(GeserveError):
    code = ErrorCode.INTERNAL


class CancelledError(GeserveError):
    code = ErrorCode.CANCELLED


class DeadlineExceededError(GeserveError):
    """The caller's deadline for the answer (gRPC's `grpc-timeout`, HTTP's `x-envoy-expected-rq-timeout-ms`) passed
    first (service/deadlines.py): gRPC DEADLINE_EXCEEDED, HTTP 504 (Triton has no answer for it), counted under its
    own failure reason."""

    code = ErrorCode.DEADLINE_EXCEEDED

    def __init__(self, message: str = "Deadline Exceeded", failure_reason: str = "DEADLINE_EXCEEDED") -> None:
        super().__init__(message, failure_reason)


class QueueTimeoutError(UnavailableError):
    """The request waited past its queue timeout (Triton's `timeout` parameter, a queue policy's default timeout)
    without starting: Triton's words and code (UNAVAILABLE, HTTP 503), counted under the failure reason
    DEADLINE_EXCEEDED."""

    def __init__(self, message: str = "Request timeout expired", failure_reason: str = "DEADLINE_EXCEEDED") -> None:
        super().__init__(message, failure_reason)


class OverloadedError(UnavailableError):
    """Refused by admission control (scheduling/admission.py) before it queued: the model cannot answer it in time.
    HTTP 503 with `Retry-After` (whole seconds, at least 1), gRPC UNAVAILABLE (the code gRPC clients retry with
    backoff) with the trailer `grpc-retry-pushback-ms`; counted REJECTED. `retry_after_ms`: the expected wait."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message, "REJECTED", headers=(("Retry-After", str(max(1, -(-retry_after_ms // 1000)))),))
        self.retry_after_ms = retry_after_ms


class UnauthenticatedError(GeserveError):
    """The call carries no credentials, or ones that do not verify (forged, expired, another audience)."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDeniedError(GeserveError):
    """The caller is known, or the call lacks a restricted API's header, and may not make this call."""

    code = ErrorCode.PERMISSION_DENIED


class UnknownSequenceError(InvalidArgumentError):
    """A request of a sequence (no START flag) whose state this process does not hold: with several workers,
    another may hold it (service/cluster.py)."""


class UnknownModelError(NotFoundError):
    """The model (or version) a call names does not exist: some Triton answers word it as plain text."""
