"""Triton's dynamic batcher: forms batches (in rows) from compatible queued requests, one place for every rule.

A batch is formed when an instance is free: it takes queued requests in priority order whose shapes match
the first one's, up to the row limit. It goes at once when it reaches a preferred size (or the limit); else
it waits until the oldest request has waited `max_queue_delay`, or until no request can come to join it
(`early_dispatch`, geserve/arrivals.py: every client connection waits on an answer and nothing executes, so waiting
longer only adds latency; the model parameter `early_batch_dispatch: "false"` turns it off). With batch gears, a
batch is cut to a gear or padded up to the next one, and the padding is sliced off the outputs. A full batch takes
no request that could not end by its caller's deadline (`_drop_doomed`): that one is answered then, and the next
request takes its place (one arriving within `max_queue_delay` of then, where none was queued).

A caller that is cancelled while its request waits (the client went away) takes the request out of the queue: it
never runs. One already in a batch runs to the end with the others, and its result is dropped. A request that is
not cancelled pays nothing for this: an `except` clause around the await costs nothing until it catches.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from geserve.arrivals import ARRIVALS
from geserve.config import ModelConfig
from geserve.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    QueueTimeoutError,
    UnavailableError,
)
from geserve.scheduling.adaptive import AdaptiveController
from geserve.scheduling.pool import InstancePool, Worker, execution_failed
from geserve.scheduling.queue import Callback, Outcome, Pending, PriorityQueue, QueuePolicy, ShapeKey
from geserve.scheduling.scheduler import AnswersLater, SchedulerKind, SchedulerParts
from geserve.types import InferenceRequest, InferenceResponse, InputTensor
from geserve.types.requests import expiry

logger = logging.getLogger(__name__)
_CANCELLED = "the request was cancelled while it was queued"


@dataclass(frozen=True, slots=True)
class BatcherSettings:
    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]  # ascending
    max_queue_delay_ns: int
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    policies: dict[int, QueuePolicy] = field(default_factory=dict)
    gears: tuple[int, ...] = ()  # ascending batch sizes the graph was compiled for; () for any size
    adaptive_target_p99_ms: float = 0.0  # 0: off
    early_dispatch: bool = True  # a batch that no request can join goes before its delay

    @classmethod
    def from_config(cls, config: ModelConfig) -> BatcherSettings:
        batching = config.dynamic_batching
        gears = parse_gears(config)
        limit = min(config.max_batch_size, gears[-1]) if gears else config.max_batch_size
        preferred = tuple(sorted(s for s in batching.preferred_batch_size if 0 < s <= limit)) or (limit,)
        levels = batching.priority_levels
        default_policy = QueuePolicy.from_config(batching.default_queue_policy)
        policies = {level: default_policy for level in range(1, max(1, levels) + 1)}
        for level, policy in batching.priority_queue_policy.items():
            policies[int(level)] = QueuePolicy.from_config(policy)
        adaptive = config.parameters.get("adaptive_batching_target_p99_ms")
        early = config.parameters.get("early_batch_dispatch")
        return cls(
            max_batch_size=limit,
            preferred_batch_sizes=preferred,
            max_queue_delay_ns=batching.max_queue_delay_microseconds * 1000,
            preserve_ordering=batching.preserve_ordering,
            priority_levels=levels,
            default_priority_level=batching.default_priority_level,
            policies=policies,
            gears=gears,
            adaptive_target_p99_ms=_positive_float("adaptive_batching_target_p99_ms", adaptive.string_value)
            if adaptive is not None
            else 0.0,
            early_dispatch=_flag("early_batch_dispatch", early.string_value) if early is not None else True,
        )


def parse_gears(config: ModelConfig) -> tuple[int, ...]:
    """The `batch_gears` parameter ("1,2,4,8"): the batch sizes a static-shape graph accepts."""
    parameter = config.parameters.get("batch_gears")
    if parameter is None or not parameter.string_value.strip():
        return ()
    try:
        gears = sorted({int(g) for g in parameter.string_value.replace(";", ",").split(",") if g.strip()})
    except ValueError:
        raise InvalidArgumentError(
            f"parameter 'batch_gears' of model '{config.name}' must list batch sizes like \"1,2,4,8\", "
            f"got '{parameter.string_value}'"
        ) from None
    if not gears or gears[0] < 1 or (config.max_batch_size and gears[-1] > config.max_batch_size):
        raise InvalidArgumentError(
            f"parameter 'batch_gears' of model '{config.name}' must hold sizes between 1 and max_batch_size "
            f"({config.max_batch_size}), got '{parameter.string_value}'"
        )
    return tuple(gears)


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise InvalidArgumentError(f"parameter '{name}' must be \"true\" or \"false\", got '{text}'")
    return value == "true"


def _positive_float(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise InvalidArgumentError(f"parameter '{name}' must be a positive number of milliseconds, got '{text}'")
    return value


def _shape_key(request: InferenceRequest) -> ShapeKey:
    """Requests batch together only when they carry the same inputs (optional ones may be left out), each with the
    same shape past the batch axis."""
    return tuple([(t.name, t.shape[1:]) for t in request.inputs])  # a list first: faster than a generator


class _Wakeup:
    """Where the batcher task sleeps: a future that arrivals resolve, with an optional deadline. asyncio.wait_for over
    an Event took a task, a timer and three callbacks per sleep, and under load the batcher sleeps once per arrival.

    Unlike an Event, a `set` while nobody sleeps is forgotten: the batcher checks its queue before every sleep, with
    no await in between, so no arrival is missed."""

    __slots__ = ("_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float | None = None) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = None if timeout_s is None else self._loop.call_later(timeout_s, self.set)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


class DynamicBatcher(AnswersLater):
    def __init__(self, model_name: str, settings: BatcherSettings, pool: InstancePool) -> None:
        self._name = model_name
        self._settings = settings
        self._pool = pool
        self._queue = PriorityQueue(settings.priority_levels, settings.default_priority_level, settings.policies)
        # Where a request with no priority and no timeout of its own goes (most requests): worked out once.
        self._default_level = self._queue.level_of(0)
        self._default_timeout_us = self._queue.policy(self._default_level).timeout_us(0)
        loop = self._loop = asyncio.get_running_loop()  # kept: each lookup costs a getpid() system call
        self._arrived = _Wakeup(loop)
        # While the batcher waits out a batch's delay with `_wake_rows` rows still missing to its limit: the rows that
        # arrived since. Arrivals that cannot make the batch due let it sleep (`_need_wake`).
        self._wake_rows = 0
        self._rows_arrived = 0
        self._sequence = 0
        self._executing = 0
        self._dispatches: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._plain_limit = (
            settings.priority_levels <= 1 and settings.preferred_batch_sizes == (settings.max_batch_size,)
            and not settings.adaptive_target_p99_ms
        )
        self._next_release = 0  # preserve_ordering: the sequence number whose result goes out next
        self._finished: dict[int, tuple[Pending, InferenceResponse | BaseException]] = {}
        self._adaptive = (
            AdaptiveController(settings.adaptive_target_p99_ms, settings.max_batch_size, settings.max_queue_delay_ns)
            if settings.adaptive_target_p99_ms
            else None
        )
        self._task = loop.create_task(self._form_batches(), name=f"batcher-{model_name}")

    @property
    def inflight_count(self) -> int:
        return self._queue.size + self._executing

    @property
    def adaptive(self) -> AdaptiveController | None:
        return self._adaptive

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        future: asyncio.Future[InferenceResponse] = self._loop.create_future()
        pending, level = self._pending(request, future)
        if self._can_bypass_queue():
            return await self._run_alone(pending)
        self._push(pending, level)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(pending)
            raise

    def schedule(
        self, request: InferenceRequest, done: Callable[[InferenceResponse | BaseException], None]
    ) -> Pending | None:
        """`enqueue` without a coroutine (InferenceService.submit): `done` is called with the response or the error the
        moment its batch completes (it must not raise), and `withdraw` takes the request back. Raises as `enqueue`
        does; None, having done nothing, when the request would bypass the queue: `enqueue` runs it at once."""
        if self._can_bypass_queue():
            return None
        pending, level = self._pending(request, Callback(done))
        self._push(pending, level)
        return pending

    def withdraw(self, pending: Pending) -> bool:
        """A scheduled request's caller went away: unless its outcome is known already (False), `done` will never be
        called and, while it still waits, it leaves the queue (as a cancelled `enqueue`)."""
        if not pending.future.cancel():
            return False
        self._cancel(pending)
        return True

    def queue_timeout_us(self, request: InferenceRequest) -> int:
        """The queue policy's timeout of `request` when it refuses (REJECT), which makes it the request's queue
        deadline (service/deadlines.py); a DELAY policy's only moves it back in this queue."""
        level, timeout_us = self._level_and_timeout(request)
        return 0 if self._queue.policy(level).delay_on_timeout else timeout_us

    def _level_and_timeout(self, request: InferenceRequest) -> tuple[int, int]:
        """`request`'s priority level and queue timeout (µs, 0: none) by Triton's rule: a request may shorten its
        level's default timeout when the policy allows it, never lengthen it. Worked out once for the common request
        (no priority, no timeout of its own)."""
        if not (request.priority or request.timeout_us):
            return self._default_level, self._default_timeout_us
        level = self._queue.level_of(request.priority)
        return level, self._queue.policy(level).timeout_us(request.timeout_us)

    def _pending(self, request: InferenceRequest, outcome: Outcome) -> tuple[Pending, int]:
        """The queue entry for `request` and its priority level; raises for a request this batcher cannot take."""
        if self._stopping:
            raise UnavailableError(f"model '{request.model_name}' is unloading")
        if self._task.done():
            raise UnavailableError(f"the batcher of model '{self._name}' has stopped")
        if request.batch_size > self._settings.max_batch_size:
            raise InvalidArgumentError(
                f"inference request batch-size must be <= {self._settings.max_batch_size} for '{self._name}'"
            )
        now = time.monotonic_ns()
        level, timeout_us = self._level_and_timeout(request)
        pending = Pending(request, outcome, now, now + timeout_us * 1000 if timeout_us else 0, self._sequence,
                          _shape_key(request))
        return pending, level

    def _push(self, pending: Pending, level: int) -> None:
        self._queue.push(pending, level)  # raises at once when the level's queue is full
        self._sequence += 1
        if self._need_wake(pending):
            self._arrived.set()

    def _need_wake(self, pending: Pending) -> bool:
        """Whether a request just queued may make the batch being formed due: always, unless the batcher waits out
        the delay of a batch that this arrival cannot fill, cannot time out before it, and cannot make quiet."""
        if not self._wake_rows:
            return True
        self._rows_arrived += pending.rows
        return (
            self._rows_arrived >= self._wake_rows
            or pending.deadline_ns != 0
            or (self._settings.early_dispatch and ARRIVALS.quiet(self._settings.max_queue_delay_ns))
        )

    def _cancel(self, pending: Pending) -> None:
        """The caller of a queued request was cancelled (its future with it): take the request out if it still
        waits. One taken into a batch already runs with it (`_dispatch` drops it if the batch has not started)."""
        pending.request.cancelled = True  # a model running it may poll this (a Python model's is_cancelled())
        if self._queue.discard(pending):
            self._complete(pending, CancelledError(_CANCELLED))  # preserve_ordering: its turn passes on
            self._arrived.set()  # the batch being formed may be due now, or have nothing left to wait for

    def _can_bypass_queue(self) -> bool:
        """Nothing to wait for and nothing to batch with: skip the batcher task's hop (no added latency)."""
        return (
            not self._queue.size
            and self._pool.has_free
            and self._limits()[1] == 0
            and not self._settings.gears
            and not self._settings.preserve_ordering
        )

    async def _run_alone(self, pending: Pending) -> InferenceResponse:
        self._executing += 1
        try:
            (result,) = await self._pool.run(self._pool.take_free(), [pending.request], [pending.enqueued_ns])
        finally:
            self._executing -= 1
        if self._adaptive is not None:
            self._adaptive.observe([time.monotonic_ns() - pending.enqueued_ns])
        if isinstance(result, BaseException):
            raise result
        return result

    async def stop(self) -> None:
        """Serve what is queued, wait for what executes, then release the instances."""
        self._stopping = True
        self._arrived.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._dispatches:
            await asyncio.gather(*self._dispatches, return_exceptions=True)
        await asyncio.to_thread(self._pool.close)

    # ---- batch forming -------------------------------------------------------------------------

    async def _form_batches(self) -> None:
        try:
            while True:
                if not self._queue.size:
                    if self._stopping:
                        return
                    await self._arrived.wait()
                    continue
                worker = await self._pool.acquire()
                batch = await self._wait_for_batch()
                if not batch:
                    self._pool.release(worker)
                    continue
                task = self._loop.create_task(self._dispatch(worker, batch))
                self._dispatches.add(task)
                task.add_done_callback(self._dispatches.discard)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("dynamic batcher of model '%s' failed", self._name)
            for pending in list(self._queue):
                self._complete(pending, UnavailableError(f"the batcher of model '{self._name}' failed: {exc}"))
            self._queue.remove(list(self._queue))
            raise

    async def _wait_for_batch(self) -> list[Pending]:
        """With an instance in hand: wait until a batch is due (preferred size, limit or delay), then take it."""
        refill_until = 0  # once doomed requests left a full batch: arrivals may take their places until then
        while True:
            now = time.monotonic_ns()
            next_timeout = self._expire(now)
            if not self._queue.size:
                return []
            limit, delay_ns = self._limits()
            batch, rows = self._candidate(limit)
            if rows == limit and self._drop_doomed(batch, rows, now):
                # Under overload the queue behind them is short (admission control keeps it so): without a wait
                # the batch ran a row or two short each time a round overran (4x, slow spells: 6.9 rows of 8).
                refill_until = refill_until or now + delay_ns
                continue
            preferred = self._preferred_prefix(batch)
            due_at = max((self._queue.oldest_enqueued_ns() or now) + delay_ns, refill_until)
            if rows < limit:
                if preferred:
                    batch = batch[:preferred]  # the largest preferred size it holds goes at once
                elif self._may_grow(now, due_at, delay_ns):
                    await self._await_arrivals(limit - rows, now, due_at, next_timeout)
                    continue
            self._queue.remove(batch)
            return batch

    def _expire(self, now: int) -> int:
        """Answer the queued requests whose queue timeout passed by `now`; when the next one's passes (0: none)."""
        rejected, next_timeout = self._queue.expire(now)
        for pending in rejected:
            self._complete(pending, QueueTimeoutError())
        return next_timeout

    def _drop_doomed(self, batch: list[Pending], rows: int, now: int) -> bool:
        """Answer now (DEADLINE_EXCEEDED) the requests of a full batch that could not end by their caller's deadline
        even were it as fast as the fastest of the latest batches its size: run, they would only be answered that
        later, in the place of requests that can still be served in time. Whether any was."""
        dated = [(p, deadline) for p in batch if (deadline := p.request.deadline) is not None]
        fastest_ns = self._pool.fastest_run(rows) if dated else 0  # a batch without deadlines scans no runs
        if not fastest_ns:
            return False
        ends = (now + fastest_ns) / 1e9
        doomed = [p for p, deadline in dated if deadline < ends]
        if not doomed:
            return False
        self._queue.remove(doomed)
        for pending in doomed:
            self._complete(pending, DeadlineExceededError())
        return True

    def _may_grow(self, now: int, due_at: int, delay_ns: int) -> bool:
        """Whether a batch short of its limit waits for more requests: before its delay, unless no request can come
        (`early_dispatch`) or the batcher is stopping."""
        return now < due_at and not self._stopping and not (self._settings.early_dispatch and ARRIVALS.quiet(delay_ns))

    async def _await_arrivals(self, missing_rows: int, now: int, due_at: int, next_timeout: int) -> None:
        """Wait for arrivals that may complete the batch, until it is due or the next request times out."""
        wake_at = min(due_at, next_timeout) if next_timeout else due_at
        # Only the row limit makes this batch due before its delay (one priority level, no other preferred
        # size, fixed limits): arrivals short of it need not wake the batcher (`_need_wake`).
        if self._plain_limit:
            self._wake_rows, self._rows_arrived = missing_rows, 0
        try:
            await self._arrived.wait((wake_at - now) / 1e9)
        finally:
            self._wake_rows = 0

    def _limits(self) -> tuple[int, int]:
        if self._adaptive is not None:
            return self._adaptive.batch_limit, self._adaptive.delay_ns
        return self._settings.max_batch_size, self._settings.max_queue_delay_ns

    def _candidate(self, limit: int) -> tuple[list[Pending], int]:
        """Queued requests, in priority order, that fit the row limit and share the first one's shapes."""
        batch: list[Pending] = []
        rows = 0
        key = None
        for pending in self._queue:
            if key is None:
                key = pending.shape_key
            elif pending.shape_key != key:
                continue
            if rows + pending.rows > limit:
                if rows:
                    break
                continue
            batch.append(pending)
            rows += pending.rows
            if rows == limit:
                break
        return batch, rows

    def _preferred_prefix(self, batch: list[Pending]) -> int:
        """How many leading requests make the largest preferred batch size exactly (0: none)."""
        preferred = self._settings.preferred_batch_sizes
        best, rows = 0, 0
        for count, pending in enumerate(batch, 1):
            rows += pending.rows
            if rows in preferred:
                best = count
        return best

    # ---- execution -----------------------------------------------------------------------------

    async def _dispatch(self, worker: Worker, batch: list[Pending]) -> None:
        live = self._live(batch)
        if not live:
            self._pool.release(worker)
            return
        batch = live
        self._executing += len(batch)
        requests, queued, padding_rows = self._requests(batch)
        try:
            results = await self._pool.run(worker, requests, queued, padding_rows)
        except Exception as exc:
            results = [execution_failed(exc)] * len(batch)
        finally:
            self._executing -= len(batch)
        for pending, result in zip(batch, results, strict=False):
            self._complete(pending, result)
        if self._adaptive is not None:
            self._observe(self._adaptive, batch)

    def _live(self, batch: list[Pending]) -> list[Pending]:
        """The requests of `batch` that may still start; the others (cancelled, or past a deadline since they were
        taken) are answered now and never run."""
        now = time.monotonic()
        live = []
        for pending in batch:
            gone = CancelledError(_CANCELLED) if pending.future.cancelled() else expiry(pending.request, now)
            if gone is None:
                live.append(pending)
            else:
                self._complete(pending, gone)
        return live

    def _requests(self, batch: list[Pending]) -> tuple[list[InferenceRequest], list[int], int]:
        """What the pool runs: the batch's requests (padded up to the next gear where it needs some), when each was
        queued, and the padding's rows."""
        requests = [p.request for p in batch]
        queued = [p.enqueued_ns for p in batch]
        padding = self._padding(requests[0], sum(p.rows for p in batch))
        if padding is None:
            return requests, queued, 0
        requests.append(padding)
        return requests, queued, padding.batch_size

    def _observe(self, adaptive: AdaptiveController, batch: list[Pending]) -> None:
        now = time.monotonic_ns()
        adaptive.observe([(now - p.enqueued_ns) for p in batch], backlogged=self._queue.size > 0)

    def _padding(self, first: InferenceRequest, rows: int) -> InferenceRequest | None:
        """Zero rows that lift a batch to the next gear; their outputs are never returned."""
        gears = self._settings.gears
        if not gears or rows in gears:
            return None
        gear = gears[bisect.bisect_left(gears, rows)]
        extra = gear - rows
        inputs = []
        for tensor in first.inputs:
            shape = (extra, *tensor.shape[1:])
            data = np.zeros(shape, dtype=tensor.data.dtype)
            if tensor.datatype == "BYTES":
                data = np.full(shape, b"", dtype=object)
            inputs.append(InputTensor(tensor.name, tensor.datatype, shape, data))
        padding = InferenceRequest(first.model_name, first.model_version, inputs, outputs=first.outputs)
        padding.batch_size = extra
        return padding

    def _complete(self, pending: Pending, result: InferenceResponse | BaseException) -> None:
        if not self._settings.preserve_ordering:
            _resolve(pending, result)
            return
        self._finished[pending.sequence] = (pending, result)
        while self._next_release in self._finished:
            _resolve(*self._finished.pop(self._next_release))
            self._next_release += 1


def _resolve(pending: Pending, result: InferenceResponse | BaseException) -> None:
    if pending.future.done():
        return
    if isinstance(result, BaseException):
        pending.future.set_exception(result)
    else:
        pending.future.set_result(result)



def _serves(config: ModelConfig) -> bool:
    """`dynamic_batching`, or batch gears (a static-shape graph needs its batches padded to a gear)."""
    return config.max_batch_size > 0 and (
        config.WhichOneof("scheduling_choice") == "dynamic_batching" or bool(parse_gears(config))
    )


def _build(parts: SchedulerParts) -> DynamicBatcher:
    return DynamicBatcher(parts.config.name, BatcherSettings.from_config(parts.config), parts.instance_pool())


SCHEDULER_KIND = SchedulerKind("dynamic_batching", _serves, _build)
