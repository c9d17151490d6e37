"""An answered, withdrawn or expired request is freed by reference counting, not left to the cyclic collector: the
deadline watch (service/deadlines.Watched) and the queue entry that calls it back referenced each other, and under
overload the collector's passes over thousands of such requests stalled the event loop for 10-44 ms
(bench/overload_bench.py). Real queue entries, a real asyncio loop and timer; the collector is off while each test
runs, so whatever only it could free stays alive and fails the test."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from geserve.scheduling.queue import Callback, Pending, PriorityQueue
from geserve.service.deadlines import Watched
from geserve.types import InferenceRequest, InferenceResponse, InputTensor


@pytest.fixture(autouse=True)
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def queued_request(deadline_in: float) -> tuple[weakref.ref[np.ndarray], Callable[[str], None], list[object]]:
    """A request queued as the service queues it, watched until `deadline_in` seconds from now: a weak reference to
    its tensor, how to settle it ("answer", "withdraw"; "expire": let its deadline pass) and the caller's answers."""
    data = np.zeros((1, 4), np.float32)
    request = InferenceRequest("m", "", [InputTensor("IN", "FP32", data.shape, data)])
    request.deadline = time.monotonic() + deadline_in
    answers: list[object] = []
    queue = PriorityQueue(levels=1, default_level=1, policies={})
    watched = Watched(answers.append, request)
    entry = Pending(request, Callback(watched), enqueued_ns=0, deadline_ns=0, sequence=0)
    queue.push(entry, 1)
    withdraw = watched.bind(lambda: queue.discard(entry))

    def settle(how: str) -> None:
        if how == "answer":
            queue.discard(entry)
            entry.future.set_result(InferenceResponse("m", "", []))
        elif how == "withdraw":
            withdraw()

    return weakref.ref(data), settle, answers


@pytest.mark.parametrize("how", ["answer", "withdraw", "expire"])
def test_a_settled_request_is_freed_without_the_cyclic_collector(how: str) -> None:
    async def scenario() -> tuple[weakref.ref[np.ndarray], list[object]]:
        tensor, settle, answers = queued_request(0.01 if how == "expire" else 10.0)
        settle(how)
        await asyncio.sleep(0.05)  # the expiring one's timer runs; the others' cancelled timers are dropped
        return tensor, answers

    tensor, answers = asyncio.run(scenario())
    assert len(answers) == (0 if how == "withdraw" else 1)
    if how == "expire":
        assert type(answers[0]).__name__ == "DeadlineExceededError"
    answers.clear()
    assert tensor() is None, gc.get_referrers(tensor())
