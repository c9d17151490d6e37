"""Who is calling and how: the call context every service call carries, Triton's API groups, and call policies.

Authorization, restriction and audit hang on the API groups, decided once in the service for every protocol.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class Transport(enum.Enum):
    """Where a call came from; the service words a few answers differently per protocol, as Triton does."""

    HTTP = "http"
    GRPC = "grpc"
    IN_PROCESS = "in_process"  # BLS calls, ensemble steps, the in-process API


class ApiGroup(enum.Enum):
    """Triton's API groups (the names `--http-restricted-api` / `--grpc-restricted-protocol` take)."""

    HEALTH = "health"
    METADATA = "metadata"
    INFERENCE = "inference"
    SHARED_MEMORY = "shared-memory"
    MODEL_CONFIG = "model-config"
    MODEL_REPOSITORY = "model-repository"
    STATISTICS = "statistics"
    TRACE = "trace"
    LOGGING = "logging"


@dataclass(slots=True)
class CallContext:
    """One call as the service sees it, whatever the protocol. Header names are lower case (gRPC metadata keys
    are too); `deadline` is on `time.monotonic()`'s clock; `identity` is set by whoever authenticated the call
    (the bearer token's `sub`); `peer_certificate_subject` by a frontend whose connection verified a client
    certificate (mutual TLS), the certificate's subject as an RFC 4514 string."""

    transport: Transport
    peer: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    identity: str | None = None
    deadline: float | None = None
    is_cancelled: Callable[[], bool] | None = None
    peer_certificate_subject: str | None = None
    # The group a frontend admitted this call for ahead of reading its body (`InferenceService.admit_ahead`): the
    # service's own admission of the call then passes, so a call's policies run once.
    admitted: ApiGroup | None = None
    # Tracing (service/tracing/), only while it is on: the frontend's receive times, taken before the service sees the
    # call; and the trace of a traced request the frontend answers, handed back for its send times.
    trace_marks: list[tuple[str, int]] | None = None
    trace: FrontendTrace | None = None

    @property
    def cancelled(self) -> bool:
        return self.is_cancelled is not None and self.is_cancelled()

    @property
    def caller(self) -> str | None:
        """Who is calling, as far as anything verified it: the authenticated identity, else the client
        certificate's subject (mutual TLS without a token, or without token authentication configured)."""
        return self.identity if self.identity is not None else self.peer_certificate_subject

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (negative once past), None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()


IN_PROCESS = CallContext(Transport.IN_PROCESS)


class FrontendTrace(Protocol):
    """A traced request's trace, as the frontend that answers it sees it (service/tracing/trace.py)."""

    def mark(self, name: str) -> None:
        """A timestamp named as Triton names it (HTTP_SEND_START, ...), taken now."""

    def finish(self, name: str) -> None:
        """The last timestamp, taken now: the trace is complete."""


class CallPolicy(Protocol):
    """A rule every call passes before the service acts (authorization, restriction, audit): raise a
    GeserveError to refuse the call."""

    def admit(self, group: ApiGroup, context: CallContext) -> None: ...
