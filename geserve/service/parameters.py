"""The rules of an inference request's parameters (priority, timeout, reserved `triton_` keys, the sequence
parameters), once for every protocol; only Triton's wording differs between HTTP and gRPC. Which wire field carries a
value is the codecs' job (gRPC's converter refuses a sequence parameter in the wrong field, in Triton's words)."""

from __future__ import annotations

from collections.abc import Callable
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
    sequence_id: str = "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."
    sequence_flag: str = "invalid value type for '{}' parameter, expected bool_param."


_WORDING = {
    Transport.HTTP: _Wording(
        reserved="parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified.",
        allowed_reserved=(),
        priority="'priority' must be a non-negative integer, got {!r}",
        timeout="'timeout' must be a non-negative integer (microseconds), got {!r}",
        # Triton's HTTP frontend reads an unsigned integer, else a string, else fails with the string's reason.
        sequence_id="Unable to parse 'sequence_id': attempt to access JSON non-string as string",
        sequence_flag="Unable to parse '{}': attempt to access JSON non-boolean as boolean",
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
        rule = _RULES.get(key)
        if rule is not None:
            rule(request, key, value, wording, transport)
        elif key.startswith("triton_"):
            if key not in wording.allowed_reserved:
                raise InvalidArgumentError(wording.reserved)
            allowed.append(key)
    if allowed:
        request.parameters = {k: v for k, v in request.parameters.items() if k not in allowed}


# One rule per parameter key Triton reads: each checks the value and sets what it sets on the request. Plain
# functions in a table built once, so a request pays one dict lookup per parameter, as the chain of ifs did.


def _priority(request: InferenceRequest, key: str, value: Any, wording: _Wording, transport: Transport) -> None:
    if not _non_negative_int(value):
        raise InvalidArgumentError(wording.priority.format(value))
    request.priority = value


def _timeout(request: InferenceRequest, key: str, value: Any, wording: _Wording, transport: Transport) -> None:
    if wording.timeout is None and isinstance(value, int):
        request.timeout_us = max(value, 0)
    elif not _non_negative_int(value):
        raise InvalidArgumentError((wording.timeout or "").format(value))
    else:
        request.timeout_us = value


def _sequence_id(request: InferenceRequest, key: str, value: Any, wording: _Wording, transport: Transport) -> None:
    # An unsigned 64-bit integer (gRPC's int64 stands for the same bits) or a string, for any model: a sequence
    # model's scheduler decides what the id means.
    if not isinstance(value, str) and not _sequence_number(value, transport):
        raise InvalidArgumentError(wording.sequence_id)


def _sequence_flag(request: InferenceRequest, key: str, value: Any, wording: _Wording, transport: Transport) -> None:
    if not isinstance(value, bool):
        raise InvalidArgumentError(wording.sequence_flag.format(key))


_Rule = Callable[[InferenceRequest, str, Any, _Wording, Transport], None]
_RULES: dict[str, _Rule] = {
    "priority": _priority,
    "timeout": _timeout,
    "sequence_id": _sequence_id,
    "sequence_start": _sequence_flag,
    "sequence_end": _sequence_flag,
}


def _sequence_number(value: Any, transport: Transport) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    low = -(1 << 63) if transport == Transport.GRPC else 0
    return low <= value < (1 << 64)


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
