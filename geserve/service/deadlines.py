"""A request's deadline, worked out and acted on in one place for every path of every protocol: refused before it
starts once passed, and answered DEADLINE_EXCEEDED at that moment while it waits (a timer, not the next dispatch).

The deadline (`InferenceRequest.deadline`, on `time.monotonic()`'s clock) is the earliest of the call's
(`CallContext.deadline`, which both gRPC transports fill from `grpc-timeout`), the request's `timeout` parameter
(µs, as its model's scheduler reads it: `queue_timeout_us`) and one it was made with (an ensemble step keeps its
ensemble's). So turning TLS on, or answering on the loop instead of in a task, changes nothing. Nothing is armed for a
request without one: all it pays is a few attribute tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from geserve.errors import DeadlineExceededError
from geserve.types import InferenceRequest, InferenceResponse

Answer = Callable[[InferenceResponse | Exception], None]
Withdraw = Callable[[], None]


class QueueTimeouts(Protocol):
    """A scheduler that decides what a request's `timeout` means for its model (a dynamic batcher's queue policy)."""

    def queue_timeout_us(self, request: InferenceRequest) -> int:
        """The timeout after which `request` is refused, µs from its arrival (0: none)."""
        ...


def due(request: InferenceRequest, call_deadline: float | None, scheduler: object, now: float) -> float | None:
    """When `request` must be answered: the earliest of the call's deadline, the one it was made with, and its
    timeout as its scheduler reads it (any other scheduler: the `timeout` parameter itself)."""
    rule = getattr(scheduler, "queue_timeout_us", None)
    timeout_us = request.timeout_us if rule is None else rule(request)
    deadline = request.deadline
    if call_deadline is not None and (deadline is None or call_deadline < deadline):
        deadline = call_deadline
    if timeout_us:
        timed = now + timeout_us / 1e6
        if deadline is None or timed < deadline:
            deadline = timed
    return deadline


def check(deadline: float | None) -> None:
    """Refuse a call whose deadline has passed: it is never started."""
    if deadline is not None and deadline <= time.monotonic():
        raise DeadlineExceededError()


class Watched:
    """An answer owed before a deadline. Whichever comes first wins, once: the answer (the timer is cancelled), the
    caller's withdrawal, or the deadline (the request is withdrawn, flagged cancelled so a batch already running it
    counts it so, and the caller answered DEADLINE_EXCEEDED)."""

    __slots__ = ("_answer", "_deadline", "_request", "_timer", "_withdraw", "done")

    def __init__(self, answer: Answer, request: InferenceRequest, deadline: float) -> None:
        self._answer = answer
        self._request = request
        self._withdraw: Withdraw | None = None
        self._deadline = deadline
        self.done = False
        delay = max(deadline - time.monotonic(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def bind(self, withdraw: Withdraw) -> Withdraw:
        """The call that withdraws the request once it is queued or running; the caller's way to withdraw it."""
        self._withdraw = withdraw
        return self.withdraw

    def __call__(self, outcome: InferenceResponse | Exception) -> None:
        if not self.done:
            self.done = True
            self._timer.cancel()
            self._answer(outcome)

    def withdraw(self) -> None:
        if not self.done:
            self.done = True
            self._timer.cancel()
            if self._withdraw is not None:
                self._withdraw()

    def _expire(self) -> None:
        if self.done:
            return
        early = self._deadline - time.monotonic()
        if early > 0:
            # uvloop's timers count whole milliseconds on a clock read once per loop turn: one may run up to about a
            # millisecond before its time. Never before the deadline: until then the request may still be answered,
            # and once withdrawn it is counted by whether its deadline has passed (DEADLINE_EXCEEDED, not CANCELED).
            self._timer = asyncio.get_running_loop().call_later(early, self._expire)
            return
        self.done = True
        self._request.cancelled = True
        if self._withdraw is not None:
            self._withdraw()
        self._answer(DeadlineExceededError())
