"""What the layers below the service see of a traced request: a sink for the timestamps they already take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from geserve.types.requests import ComputeTimes, InferenceRequest


class RequestTrace(Protocol):
    """One sampled request's trace (service/tracing/trace.py). Set on `InferenceRequest.trace` only for a request
    the service chose to trace, so an untraced request costs the scheduler one attribute test."""

    def executed(
        self,
        queue_start_ns: int,
        compute_start_ns: int,
        compute_end_ns: int,
        compute: ComputeTimes,
        batch: Sequence[InferenceRequest],
    ) -> None:
        """The execution this request ran in (monotonic ns): when it was queued, the compute span and its three
        phases, and the requests that shared the batch."""

    def child(self) -> RequestTrace:
        """A trace for a request made on this one's behalf (an ensemble step), traced whatever the sampling."""
