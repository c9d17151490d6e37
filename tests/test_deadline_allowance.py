"""A caller's deadline is kept its delivery allowance early (service/deadlines.py), so that a success given at the
deadline reaches the caller in time; and a withdrawn request leaves the batcher's queue without its tensors being
formatted (scheduling/queue.py). Pure functions and the queue itself: no server is needed to pin these."""

from __future__ import annotations

import numpy as np
import pytest

from geserve.scheduling.queue import Callback, Pending, PriorityQueue
from geserve.service.deadlines import DELIVERY_ALLOWANCE_S, caller_deadline, delivery_allowance, http_deadline
from geserve.types import InferenceRequest, InputTensor


@pytest.mark.parametrize(("seconds", "allowance"), [(10.0, DELIVERY_ALLOWANCE_S), (0.05, DELIVERY_ALLOWANCE_S),
                                                    (0.005, 0.0005), (0.0, 0.0)])
def test_the_allowance_is_a_millisecond_or_a_tenth_of_a_short_timeout(seconds: float, allowance: float) -> None:
    assert delivery_allowance(seconds) == pytest.approx(allowance)
    assert caller_deadline(100.0, seconds) == pytest.approx(100.0 + seconds - allowance)


def test_the_gateway_header_gives_a_caller_deadline() -> None:
    assert http_deadline(b"50", 100.0) == pytest.approx(100.05 - DELIVERY_ALLOWANCE_S)


@pytest.mark.parametrize("raw", [None, b"", b"soon", b"0", b"-5"])
def test_a_missing_or_unusable_gateway_header_gives_no_deadline(raw: bytes | None) -> None:
    assert http_deadline(raw, 100.0) is None


class Unprintable(np.ndarray):
    """A tensor whose printing fails the test: what the queue must never do to a request it withdraws."""

    def __repr__(self) -> str:
        raise AssertionError("the queue formatted a request's tensor")


def pending(name: str) -> Pending:
    data = np.zeros((1, 4), np.float32).view(Unprintable)
    request = InferenceRequest("m", "", [InputTensor("IN", "FP32", data.shape, data)], id=name)
    return Pending(request, Callback(lambda _: None), enqueued_ns=0, deadline_ns=0, sequence=0)


def test_a_withdrawn_request_leaves_the_queue_once_and_its_tensors_are_never_printed() -> None:
    queue = PriorityQueue(levels=2, default_level=2, policies={})
    first, second = pending("first"), pending("second")
    queue.push(first, 1)
    queue.push(second, 2)
    assert queue.discard(second)
    assert not queue.discard(second)
    assert (queue.size, queue.rows, list(queue)) == (1, 1, [first])
