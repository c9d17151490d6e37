"""A request's deadlines, worked out and acted on in one place for every path of every protocol: a request past one is
never started, and one still waiting when it passes is answered at that moment (a timer, not the next dispatch).

Two kinds, on `time.monotonic()`'s clock (service time and models' clocks alike):

- `InferenceRequest.deadline`, when the caller stops waiting for the answer: the call's (`CallContext.deadline`,
  from gRPC's `grpc-timeout` on both transports and HTTP's `x-envoy-expected-rq-timeout-ms`) or the one the request
  was made with (an ensemble's steps keep their ensemble's), the earlier. It holds while the request runs too:
  a success is never delivered after it (DEADLINE_EXCEEDED).
- `InferenceRequest.queue_deadline`, Triton's queue timeout: the `timeout` parameter (µs) and the queue policy's
  default timeout, as the model's scheduler reads them (`queue_timeout_us`: Triton's override rule, REJECT only;
  any other scheduler takes the parameter itself). It holds until the request starts; then the request runs to its
  end, as in Triton, whose words and code answer it (UNAVAILABLE "Request timeout expired").

So turning TLS on, or answering on the loop instead of in a task, changes nothing. Nothing is armed for a request
without either: all it pays is a few attribute tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from geserve.devices.loop_batching import LOOP_BATCHING
from geserve.errors import DeadlineExceededError
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.requests import expiry

Answer = Callable[[InferenceResponse | Exception], None]
Withdraw = Callable[[], None]
# The deadline a gateway in front of the server gives an HTTP request (Envoy, Istio, hence KServe, set it): the
# milliseconds the caller will wait for the answer.
HTTP_DEADLINE_HEADER = b"x-envoy-expected-rq-timeout-ms"


# The time an answer takes from the service to its caller (encoding, the socket, the network, the caller's parsing)
# and a request from its caller to the service: a caller's deadline is kept this much early, so that a success
# given at its deadline still reaches the caller before the caller's own clock says it is late. At most a tenth of
# the caller's timeout, so that a short one keeps most of its time.
DELIVERY_ALLOWANCE_S = 0.001
_DELIVERY_SHARE = 0.1


def delivery_allowance(seconds: float) -> float:
    """How much early the deadline of a caller who waits `seconds` is kept."""
    return min(DELIVERY_ALLOWANCE_S, _DELIVERY_SHARE * seconds)


def caller_deadline(now: float, seconds: float) -> float:
    """The deadline of a caller who, at `now`, will wait `seconds` more for the answer: its delivery allowance
    before that, and the time the request may have waited unread while the loop was batch-scheduled
    (devices/loop_batching.py): the caller's clock started then."""
    return now + seconds - delivery_allowance(seconds) - LOOP_BATCHING.read_delay_s(now)


def http_deadline(raw: bytes | None, now: float) -> float | None:
    """The deadline an HTTP request's gateway header gives, None without a usable one (a malformed value is ignored,
    as a gateway's hint should be)."""
    if raw is None:
        return None
    try:
        milliseconds = int(raw)
    except ValueError:
        return None
    return caller_deadline(now, milliseconds / 1000) if milliseconds > 0 else None


def assign(request: InferenceRequest, call_deadline: float | None, scheduler: object, now: float) -> None:
    """Set `request`'s deadline (the call's or the one it was made with, the earlier) and its queue deadline (its
    timeout as its scheduler reads it: a scheduler's `queue_timeout_us(request)` -> µs, 0 for none, where it has
    one, else the `timeout` parameter itself)."""
    if call_deadline is not None:
        made_with = request.deadline
        request.deadline = call_deadline if made_with is None or call_deadline < made_with else made_with
    rule = getattr(scheduler, "queue_timeout_us", None)
    timeout_us = request.timeout_us if rule is None else rule(request)
    request.queue_deadline = now + timeout_us / 1e6 if timeout_us else None


async def within(wait: Awaitable[None], request: InferenceRequest, call_deadline: float | None) -> None:
    """Await `wait` (its model's load on demand) until the request's deadline at most (the call's or the one it was
    made with): DeadlineExceededError if the deadline comes first. That wait is the request's queue time: its queue
    deadline, counted from its arrival (`assign`), is checked once it has its model."""
    due = min((d for d in (call_deadline, request.deadline) if d is not None), default=None)
    if due is None:
        await wait
        return
    try:
        await asyncio.wait_for(wait, max(due - time.monotonic(), 0.0))
    except asyncio.TimeoutError:  # not the builtin before 3.11
        raise DeadlineExceededError() from None


def check(request: InferenceRequest) -> None:
    """Refuse a request past a deadline: it is never started."""
    error = expiry(request, time.monotonic())
    if error is not None:
        raise error


def next_due(request: InferenceRequest) -> float | None:
    """The earlier of `request`'s deadlines still ahead of it, None when none is left."""
    deadline, queued = request.deadline, request.queue_deadline
    if queued is None:
        return deadline
    return queued if deadline is None or queued < deadline else deadline


def _answered(_: InferenceResponse | Exception) -> None:
    """A settled Watched's answer: it was given already."""


class Watched:
    """An answer owed before a deadline. Whichever comes first wins, once: the answer (the timer is cancelled), the
    caller's withdrawal, or a deadline: the request is withdrawn, flagged cancelled so that a batch already running it
    counts it so, and the caller answered with what passed. A queue deadline that passes after the request started
    is no longer its (the pool cleared it): the timer then waits for the deadline, if any."""

    __slots__ = ("_answer", "_due", "_request", "_timer", "_withdraw", "done")

    def __init__(self, answer: Answer, request: InferenceRequest) -> None:
        self._answer = answer
        self._request = request
        self._withdraw: Withdraw | None = None
        self.done = False
        self._due = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def bind(self, withdraw: Withdraw) -> Withdraw:
        """Arm the timer, once the request is queued or running, with the call that withdraws it; returns the
        caller's way to withdraw it. (Not armed before: a request its scheduler did not take is no one's to answer.)"""
        self._withdraw = withdraw
        due = next_due(self._request)
        if due is not None:
            self._arm(due, time.monotonic())
        return self.withdraw

    def _arm(self, due: float, now: float) -> None:
        self._due = due
        self._timer = asyncio.get_running_loop().call_later(max(due - now, 0.0), self._expire)

    def __call__(self, outcome: InferenceResponse | Exception) -> None:
        if not self.done:
            answer, _ = self._settle()
            answer(outcome)

    def withdraw(self) -> None:
        if not self.done:
            _, withdraw = self._settle()
            if withdraw is not None:
                withdraw()

    def _settle(self) -> tuple[Answer, Withdraw | None]:
        """Decided: the timer cancelled, and the answer and the withdrawal handed out and let go. Held on, they made
        a reference cycle (this, its withdrawal, the queue entry, the entry's callback: this again) that only the
        cyclic collector freed, every expired request's tensors with it: collections of 10-44 ms on the event loop
        at 4x overload."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        answer, withdraw = self._answer, self._withdraw
        self._answer, self._withdraw = _answered, None
        return answer, withdraw

    def _expire(self) -> None:
        if self.done:
            return
        now = time.monotonic()
        error = expiry(self._request, now) if self._due <= now else None
        if error is None:
            # uvloop's timers count whole milliseconds on a clock read once per loop turn: one may run up to about a
            # millisecond early. Never before its time: until then the request may still be answered, and once
            # withdrawn it is counted by the deadline that passed. Or the queue deadline went when the request started.
            due = next_due(self._request)
            self._timer = None
            if due is not None:
                self._arm(due, now)
            return
        self._timer = None  # this one has run: nothing to cancel
        answer, withdraw = self._settle()
        self._request.cancelled = True
        if withdraw is not None:
            withdraw()
        answer(error)
