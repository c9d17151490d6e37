"""The dynamic batcher's queue: priority levels, each with Triton's queue policy (timeouts, size limit)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from tritonclient.grpc import model_config_pb2

from geserve.errors import UnavailableError
from geserve.types import InferenceRequest, InferenceResponse

_DELAY = model_config_pb2.ModelQueuePolicy.DELAY
# Requests batch together only when their keys are equal: each input's name and shape past the batch axis.
ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    delay_on_timeout: bool = False  # timeout_action DELAY; REJECT otherwise
    default_timeout_us: int = 0  # 0: no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded

    @classmethod
    def from_config(cls, policy: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
        return cls(
            delay_on_timeout=policy.timeout_action == _DELAY,
            default_timeout_us=policy.default_timeout_microseconds,
            allow_timeout_override=policy.allow_timeout_override,
            max_queue_size=policy.max_queue_size,
        )

    def timeout_us(self, requested_us: int) -> int:
        """Triton: a request may shorten the default timeout (when allowed), never lengthen it."""
        if self.allow_timeout_override and requested_us > 0:
            return min(requested_us, self.default_timeout_us) if self.default_timeout_us else requested_us
        return self.default_timeout_us


class Outcome(Protocol):
    """What the batcher does with a queued request's future: asyncio's, or a `Callback` for a caller that awaits
    nothing."""

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def cancel(self) -> bool: ...

    def set_result(self, result: InferenceResponse) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


class Callback:
    """A queued request's outcome handed to a function the moment the batch completes, within the batcher's own call:
    no future, done callback or loop turn per request (InferenceService.submit's queued run step). The function
    must not raise."""

    __slots__ = ("_call", "_state")

    def __init__(self, call: Callable[[InferenceResponse | BaseException], None]) -> None:
        self._call = call
        self._state = 0  # 0: waiting, 1: done, 2: cancelled

    def done(self) -> bool:
        return self._state != 0

    def cancelled(self) -> bool:
        return self._state == 2

    def cancel(self) -> bool:
        if self._state:
            return False
        self._state = 2
        return True

    def set_result(self, result: InferenceResponse) -> None:
        self._state = 1
        self._call(result)

    def set_exception(self, exception: BaseException) -> None:
        self._state = 1
        self._call(exception)


@dataclass(slots=True, eq=False)
class Pending:
    """A queued request with its future and the times the batcher decides by (monotonic ns)."""

    request: InferenceRequest
    future: Outcome
    enqueued_ns: int
    deadline_ns: int  # 0: none
    sequence: int
    shape_key: ShapeKey = field(default=())
    delayed: bool = False  # timed out under a DELAY policy: served after every timely request

    @property
    def rows(self) -> int:
        return self.request.batch_size


class PriorityQueue:
    """Levels 1..N (1 first), FIFO within a level; delayed requests go after all timely ones."""

    def __init__(self, levels: int, default_level: int, policies: dict[int, QueuePolicy]) -> None:
        self._levels = max(1, levels)
        self._default = default_level if 1 <= default_level <= self._levels else 1
        self._policies = policies
        self._queues: dict[int, collections.deque[Pending]] = {
            level: collections.deque() for level in range(1, self._levels + 1)
        }
        self._delayed: collections.deque[Pending] = collections.deque()
        self.size = 0
        self.rows = 0

    def level_of(self, priority: int) -> int:
        """Triton: priority 0 or one past the configured levels means the default level."""
        return priority if 1 <= priority <= self._levels else self._default

    def policy(self, level: int) -> QueuePolicy:
        return self._policies.get(level, QueuePolicy())

    def push(self, pending: Pending, level: int) -> None:
        policy = self.policy(level)
        queue = self._queues[level]
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            raise UnavailableError("Exceeds maximum queue size")
        queue.append(pending)
        self.size += 1
        self.rows += pending.rows

    def __iter__(self) -> Iterator[Pending]:
        """Every queued request in the order batches take them."""
        for level in range(1, self._levels + 1):
            yield from self._queues[level]
        yield from self._delayed

    def oldest_enqueued_ns(self) -> int | None:
        oldest = [q[0].enqueued_ns for q in self._queues.values() if q]
        if self._delayed:
            oldest.append(self._delayed[0].enqueued_ns)
        return min(oldest) if oldest else None

    def remove(self, taken: list[Pending]) -> None:
        ids = {id(p) for p in taken}
        for level, queue in self._queues.items():
            if any(id(p) in ids for p in queue):
                self._queues[level] = _without(queue, ids)
        if any(id(p) in ids for p in self._delayed):
            self._delayed = _without(self._delayed, ids)
        self.size -= len(taken)
        self.rows -= sum(p.rows for p in taken)

    def discard(self, pending: Pending) -> bool:
        """Take out one request wherever it waits (its caller was cancelled); False when it is not queued (any more).
        A linear search: only a cancellation pays it."""
        for queue in (*self._queues.values(), self._delayed):
            # Looked for first: a deque's remove of an absent item formats the item's repr into its error (the
            # request's tensors, through numpy's printing: about a millisecond of the loop's time per request).
            if pending not in queue:  # Pending compares by identity (eq=False)
                continue
            queue.remove(pending)
            self.size -= 1
            self.rows -= pending.rows
            return True
        return False

    def expire(self, now_ns: int) -> tuple[list[Pending], int]:
        """Apply timeouts: return the requests rejected now, and the next deadline still pending (0: none)."""
        rejected: list[Pending] = []
        next_deadline = 0
        for level, queue in self._queues.items():
            if not any(p.deadline_ns for p in queue):
                continue
            keep: collections.deque[Pending] = collections.deque()
            for pending in queue:
                if pending.deadline_ns and pending.deadline_ns <= now_ns:
                    self._time_out(pending, level, rejected)
                    continue
                if pending.deadline_ns and (not next_deadline or pending.deadline_ns < next_deadline):
                    next_deadline = pending.deadline_ns
                keep.append(pending)
            self._queues[level] = keep
        return rejected, next_deadline

    def _time_out(self, pending: Pending, level: int, rejected: list[Pending]) -> None:
        """A request past its deadline: delayed behind the timely ones (DELAY policy), else onto `rejected`."""
        if self.policy(level).delay_on_timeout:
            pending.delayed, pending.deadline_ns = True, 0
            self._delayed.append(pending)
        else:
            rejected.append(pending)
            self.size -= 1
            self.rows -= pending.rows


def _without(queue: collections.deque[Pending], ids: set[int]) -> collections.deque[Pending]:
    return collections.deque(p for p in queue if id(p) not in ids)
