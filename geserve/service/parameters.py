"""The rules of an inference request's parameters (priority, timeout, reserved `triton_` keys), once for every
protocol; only Triton's wording differs between HTTP and gRPC. Which wire field carries a value is the codecs' job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from geserve.errors import InvalidArgumentError
from geserve.service.context import Transport
from geserve.types import InferenceRequest

EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


@dataclass(frozen=True, slots=True)
class _Wording:
    reserved: str
    allowed_reserved: tuple[str, ...]
    priority: str  # formatted with the value
    timeout: str | None  # None: a negative timeout means none (Triton's gRPC clamps it to 0)


_WORDING = {
    Transport.HTTP: _Wording(
        reserved="parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified.",
        allowed_reserved=(),
        priority="'priority' must be a non-negative integer, got {!r}",
        timeout="'timeout' must be a non-negative integer (microseconds), got {!r}",
    ),
    Transport.GRPC: _Wording(
        reserved=(
            "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
            f"starting with 'triton_' are allowed: {EMPTY_FINAL_RESPONSE}"
        ),
        allowed_reserved=(EMPTY_FINAL_RESPONSE,),
        priority="invalid value for 'priority', expected value >= 0.",
        timeout=None,
    ),
}


def apply_parameters(request: InferenceRequest, transport: Transport) -> None:
    """Set `request.priority` / `timeout_us` from its parameters and refuse reserved keys; the parameters the
    model sees lose the reserved keys a protocol allows. In-process requests set their fields directly."""
    wording = _WORDING.get(transport)
    if wording is None or not request.parameters:
        return
    allowed: list[str] = []
    for key, value in request.parameters.items():
        if key == "priority":
            if not _non_negative_int(value):
                raise InvalidArgumentError(wording.priority.format(value))
            request.priority = value
        elif key == "timeout":
            if wording.timeout is None and isinstance(value, int):
                request.timeout_us = max(value, 0)
            elif not _non_negative_int(value):
                raise InvalidArgumentError((wording.timeout or "").format(value))
            else:
                request.timeout_us = value
        elif key.startswith("triton_"):
            if key not in wording.allowed_reserved:
                raise InvalidArgumentError(wording.reserved)
            allowed.append(key)
    if allowed:
        request.parameters = {k: v for k, v in request.parameters.items() if k not in allowed}


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
