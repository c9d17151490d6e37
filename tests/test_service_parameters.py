"""The request parameter rules the service applies once for every protocol, in each protocol's wording."""

from __future__ import annotations

from typing import Any

import pytest

from geserve.errors import InvalidArgumentError
from geserve.service.context import Transport
from geserve.service.parameters import EMPTY_FINAL_RESPONSE, apply_parameters
from geserve.types import InferenceRequest


def _applied(parameters: dict[str, Any], transport: Transport) -> InferenceRequest:
    request = InferenceRequest("m", "", [], parameters=dict(parameters))
    apply_parameters(request, transport)
    return request


@pytest.mark.parametrize("transport", [Transport.HTTP, Transport.GRPC])
def test_priority_and_timeout_become_request_fields(transport: Transport) -> None:
    request = _applied({"priority": 2, "timeout": 1500, "custom": "kept"}, transport)
    assert (request.priority, request.timeout_us) == (2, 1500)
    assert request.parameters == {"priority": 2, "timeout": 1500, "custom": "kept"}  # the model still sees them


def test_reserved_keys_are_refused_in_each_protocols_words() -> None:
    with pytest.raises(InvalidArgumentError, match="reserved for Triton usage and should not be specified"):
        _applied({EMPTY_FINAL_RESPONSE: True}, Transport.HTTP)  # moved here from the HTTP codec's tests
    with pytest.raises(InvalidArgumentError, match=f"Only the following keys .* allowed: {EMPTY_FINAL_RESPONSE}"):
        _applied({"triton_other": True}, Transport.GRPC)
    # gRPC allows the one reserved key Triton's streams read; the model does not see it.
    assert _applied({EMPTY_FINAL_RESPONSE: True, "x": 1}, Transport.GRPC).parameters == {"x": 1}


def test_bad_priorities_and_timeouts() -> None:
    for value in (-1, True, "1"):
        with pytest.raises(InvalidArgumentError, match="'priority' must be a non-negative integer"):
            _applied({"priority": value}, Transport.HTTP)
    with pytest.raises(InvalidArgumentError, match=r"invalid value for 'priority', expected value >= 0\."):
        _applied({"priority": -1}, Transport.GRPC)
    with pytest.raises(InvalidArgumentError, match="'timeout' must be a non-negative integer"):
        _applied({"timeout": -5}, Transport.HTTP)
    assert _applied({"timeout": -5}, Transport.GRPC).timeout_us == 0  # Triton's gRPC reads it as no timeout


def test_in_process_requests_keep_their_fields() -> None:
    request = InferenceRequest("m", "", [], parameters={"priority": -1, "triton_x": 1}, priority=3)
    apply_parameters(request, Transport.IN_PROCESS)
    assert request.priority == 3 and request.parameters == {"priority": -1, "triton_x": 1}
