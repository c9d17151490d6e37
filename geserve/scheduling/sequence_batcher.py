"""Triton's sequence batcher: the requests of one sequence (one correlation id) go, in order, to the slot the
sequence was given on one instance, with the control inputs filled in and the implicit state kept in between.

As in Triton's SequenceBatchScheduler: a request names its sequence by the `sequence_id` parameter and marks the
first and last with `sequence_start` / `sequence_end`. A START takes a free slot (lowest slot number first, across
the instances), or waits in the backlog until a sequence ends; every later request follows its sequence. A sequence
idle for `max_sequence_idle_microseconds` loses its slot (the reaper), and a request that names no live sequence
without START is refused. How each instance batches its slots is the strategy's (scheduling/sequence_strategies.py).

A cancelled request (its caller went away) ends its sequence, as in Triton: the sequence's requests still waiting
are answered CANCELLED and never run, one already running finishes (its result dropped), and the slot is released
once nothing of the sequence runs; a later request of that id needs a START.

Everything runs on the event loop, with one task per instance and the reaper; when any of them dies, every request
still held fails with the reason rather than waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from geserve.config import ModelConfig
from geserve.config.sequence import SequenceSettings, is_sequence_model
from geserve.errors import CancelledError, InvalidArgumentError, UnavailableError, UnknownSequenceError
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.scheduler import AnswersLater, SchedulerKind, SchedulerParts
from geserve.scheduling.sequence_requests import SequenceId, SequenceInputs, sequence_id
from geserve.scheduling.sequence_strategies import FORCE_END, DirectRunner, Item, OldestRunner, Pending, Runner, Slot
from geserve.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

_BACKLOG_IDLE_RECHECK_NS = 50_000_000  # Triton's reaper looks again at an idle sequence still in the backlog
_SEQUENCE_EXPIRED = "timeout of the corresponding sequence has been expired"
_STOPPING = "Server is stopping, scheduler for model has stopped accepting new inference requests"


@dataclass(eq=False, slots=True)
class _Backlog:
    """A sequence waiting for a slot: its requests so far, and when the earliest of their timeouts expires."""

    requests: deque[Pending]
    expires_ns: int = 0  # 0: none of them has a timeout


class SequenceBatcher(AnswersLater):
    def __init__(self, model_name: str, settings: SequenceSettings, pool: InstancePool) -> None:
        self.settings = settings
        self.pool = pool
        self.inputs = SequenceInputs(model_name, settings)
        self._name = model_name
        runner = OldestRunner if settings.oldest else DirectRunner
        self._runners: list[Runner] = [runner(self, worker, i) for i, worker in enumerate(pool.workers)]
        # Free slots as (slot, instance): slot 0 of every instance before slot 1 of any, as Triton hands them out.
        self._free: list[tuple[int, int]] = [
            (s, r) for s in range(settings.slots_per_instance) for r in range(len(self._runners))
        ]
        heapq.heapify(self._free)
        self._assigned: dict[SequenceId, Slot] = {}
        self._backlog_of: dict[SequenceId, _Backlog] = {}  # a sequence still collecting in the backlog
        self._backlogs: deque[_Backlog] = deque()
        self._last_seen: dict[SequenceId, int] = {}  # monotonic ns of each sequence's latest request
        self._outstanding = 0  # requests accepted and not yet answered
        self._drained = asyncio.Event()
        self._drained.set()
        self._stopping = False
        self._failure: BaseException | None = None
        self._reaper_wake = asyncio.Event()
        self._reaper_due_ns = 0
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._guard(r.serve()), name=f"sequence-{model_name}-{r.index}") for r in self._runners
        ]
        self._tasks.append(loop.create_task(self._guard(self._reap()), name=f"sequence-reaper-{model_name}"))

    def queue_timeout_us(self, request: InferenceRequest) -> int:
        """None of a sequence request's `timeout` is its deadline (service/deadlines.py): as in Triton it counts only
        while its sequence waits in the backlog, and then fails the whole backlog (`_reap`)."""
        return 0

    @property
    def inflight_count(self) -> int:
        return self._outstanding

    # ---- enqueue ---------------------------------------------------------------------------------------------

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        corrid, start, end = self._admit(request)
        slot = self._assigned.get(corrid)
        backlog = self._backlog_of.get(corrid)
        known = slot is not None or backlog is not None
        if not start and not known:
            raise UnknownSequenceError(
                f"inference request for sequence {corrid} to model '{self._name}' must specify the START flag on the "
                f"first request of the sequence"
            )
        now = time.monotonic_ns()
        self._last_seen[corrid] = now
        if start and known:
            logger.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end before this sequence "
                "start. Previous sequence will be terminated early.", corrid, self._name,
            )
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        pending = Pending(request, future, now, corrid, start, end)
        self._outstanding += 1
        self._drained.clear()
        if not known and self._free:
            slot = self._take_free_slot(corrid)
        if slot is not None:
            self._to_slot(slot, pending)
        else:
            self._to_backlog(pending, backlog, now)
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(pending)
            raise

    def _admit(self, request: InferenceRequest) -> tuple[SequenceId, bool, bool]:
        """The request's sequence id and START / END flags, once it passes the checks that need no sequence state."""
        if self._failure is not None:
            raise UnavailableError(f"the sequence batcher of model '{self._name}' failed: {self._failure}")
        if request.batch_size > 1:
            raise InvalidArgumentError(
                f"inference request to model '{self._name}' must specify batch-size 1 due to requirements of "
                f"sequence batcher"
            )
        corrid = sequence_id(request.parameters.get("sequence_id"))
        if corrid is None:
            raise InvalidArgumentError(
                f"inference request to model '{self._name}' must specify a non-zero or non-empty correlation ID"
            )
        start = bool(request.parameters.get("sequence_start"))
        end = bool(request.parameters.get("sequence_end"))
        if self._stopping and start:
            raise UnavailableError(_STOPPING)
        self._check_id_type(corrid)
        return corrid, start, end

    def _take_free_slot(self, corrid: SequenceId) -> Slot:
        index, runner = heapq.heappop(self._free)
        slot = self._runners[runner].slots[index]
        slot.corrid = corrid
        self._assigned[corrid] = slot
        return slot

    def _to_slot(self, slot: Slot, pending: Pending) -> None:
        if pending.end:  # a later request of this id needs a START again (the slot frees once this one has run)
            del self._assigned[pending.corrid]
        try:
            slot.runner.enqueue(slot, pending)  # the oldest strategy may issue it here and now
        except Exception as exc:
            self._fail(exc)

    def _check_id_type(self, corrid: SequenceId) -> None:
        """The id's type must be the one the model's CORRID control takes (Triton does not check, and copies the
        wrong bytes); without one either kind is fine."""
        control = self.settings.corrid
        if control is None or isinstance(corrid, str) == (control.datatype.wire == "BYTES"):
            return
        wanted = "a string" if control.datatype.wire == "BYTES" else "an unsigned integer"
        raise InvalidArgumentError(
            f"inference request for sequence {corrid} to model '{self._name}' must give {wanted} 'sequence_id': the "
            f"model's {control.kind_name} input '{control.name}' is {control.datatype.config_name}"
        )

    def _to_backlog(self, pending: Pending, backlog: _Backlog | None, now: int) -> None:
        if backlog is None:
            backlog = _Backlog(deque())
            self._backlogs.append(backlog)
            self._backlog_of[pending.corrid] = backlog
        backlog.requests.append(pending)
        if pending.end:
            self._backlog_of.pop(pending.corrid, None)  # a request after this one starts a sequence of its own
        timeout_us = pending.request.timeout_us
        if timeout_us:
            expires = now + timeout_us * 1000
            backlog.expires_ns = min(backlog.expires_ns, expires) if backlog.expires_ns else expires
            if not self._reaper_due_ns or expires < self._reaper_due_ns:
                self._reaper_wake.set()

    # ---- what the runners call --------------------------------------------------------------------------------

    def release_slot(self, slot: Slot) -> bool:
        """Triton's ReleaseSequenceSlot: the oldest backlogged sequence moves into the slot (True), else it is free."""
        slot.state = None
        if self._backlogs:
            backlog = self._backlogs.popleft()
            slot.queue.extend(backlog.requests)
            last = backlog.requests[-1]
            slot.corrid = last.corrid
            if not last.end:  # still collecting: its next requests go to the slot now
                if self._backlog_of.get(last.corrid) is backlog:
                    del self._backlog_of[last.corrid]
                self._assigned[last.corrid] = slot
                # Idle from now on: the time it waited for a slot was the server's, not the client's (Triton would
                # count it, and could take the slot back at once).
                self._last_seen[last.corrid] = time.monotonic_ns()
            return True
        slot.corrid = None
        heapq.heappush(self._free, (slot.index, slot.runner.index))
        return False

    def finish(self, item: Item, result: InferenceResponse | BaseException) -> None:
        if not isinstance(result, BaseException) and item.state is not None:
            self.inputs.take_state(result, item.state, item.pending.request.outputs)
        self._answer(item.pending, result)

    def _answer(self, pending: Pending, result: InferenceResponse | BaseException) -> None:
        if pending.answered:  # failed already, when a task of the batcher died while it ran
            return
        pending.answered = True
        future = pending.future
        if not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._outstanding -= 1
        if not self._outstanding:
            self._drained.set()

    # ---- cancellation -----------------------------------------------------------------------------------------

    def _cancel(self, pending: Pending) -> None:
        """The caller of `pending` was cancelled: Triton cancels the sequence's other pending requests too, and the
        sequence ends (see the module docstring). Only a cancellation pays for the search."""
        pending.request.cancelled = True
        error = CancelledError(f"a request of sequence {pending.corrid} was cancelled: the sequence has ended")
        for backlog in self._backlogs:
            if pending in backlog.requests:
                self._cancel_in_backlog(backlog, pending, error)
                return
        for runner in self._runners:
            for slot in runner.slots:
                if pending in slot.queue:
                    self._end_in_slot(slot, slot.queue.index(pending), pending, error)
                    return
            item = runner.withdraw(pending)
            if item is not None:  # taken from its slot, not yet in a batch: it never runs
                self._answer(pending, error)
                self._end_in_slot(item.slot, None, pending, error)
                runner.resume(item.slot)
                return
            for item in runner.executing:
                if item.pending is pending:
                    item.request.cancelled = True  # the copy its instance runs: what a Python model polls
                    self._end_in_slot(item.slot, None, pending, error)
                    return

    def _cancel_in_backlog(self, backlog: _Backlog, pending: Pending, error: CancelledError) -> None:
        requests = backlog.requests
        lo, hi = _sequence_span(requests, requests.index(pending), pending.corrid)
        if hi == len(requests) and self._backlog_of.get(pending.corrid) is backlog:
            del self._backlog_of[pending.corrid]  # a later request of this id needs a START
        removed = [requests[i] for i in range(lo, hi)]
        for _ in removed:
            del requests[lo]
        if requests:
            timeouts = [p.enqueued_ns + p.request.timeout_us * 1000 for p in requests if p.request.timeout_us]
            backlog.expires_ns = min(timeouts, default=0)
        else:
            self._backlogs.remove(backlog)
        for cancelled in removed:
            self._answer(cancelled, error)

    def _end_in_slot(self, slot: Slot, index: int | None, pending: Pending, error: CancelledError) -> None:
        """Cancel the requests of `pending`'s sequence waiting in `slot` (around `index`, or at the front when
        `pending` already left the queue) and end the sequence: the reaper's mark releases the slot after whatever of
        the sequence still runs."""
        queue = slot.queue
        corrid = pending.corrid
        lo, hi = _sequence_span(queue, index, corrid)
        at_tail = hi == len(queue)
        removed = _cut(queue, lo, hi)
        released_by_end = any(entry.end for entry in removed)  # its END is gone: the mark must release the slot
        still_open = at_tail and not pending.end and not released_by_end and self._assigned.get(corrid) is slot
        if still_open:
            del self._assigned[corrid]  # a later request of this id needs a START
        for cancelled in removed:
            self._answer(cancelled, error)
        if released_by_end or still_open:
            slot.runner.enqueue(slot, FORCE_END)

    # ---- the reaper --------------------------------------------------------------------------------------------

    async def _reap(self) -> None:
        """Release the slots of idle sequences (after their queued requests) and fail backlogs past their timeout."""
        idle_ns = self.settings.idle_ns
        while True:
            now = time.monotonic_ns()
            due = now + idle_ns
            for corrid, seen in list(self._last_seen.items()):
                if now - seen < idle_ns:
                    due = min(due, seen + idle_ns)
                    continue
                slot = self._assigned.pop(corrid, None)
                if slot is not None:
                    logger.debug("model '%s': sequence %s idle past %d us, its slot is released",
                                 self._name, corrid, idle_ns // 1000)
                    del self._last_seen[corrid]
                    slot.runner.enqueue(slot, FORCE_END)
                elif corrid in self._backlog_of:
                    due = min(due, now + _BACKLOG_IDLE_RECHECK_NS)  # it gets a slot first; look again soon
                else:
                    del self._last_seen[corrid]  # it ended
            for backlog in [b for b in self._backlogs if b.expires_ns]:
                if backlog.expires_ns <= now:
                    self._expire(backlog)
                else:
                    due = min(due, backlog.expires_ns)
            self._reaper_due_ns = due
            self._reaper_wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before 3.11
                await asyncio.wait_for(self._reaper_wake.wait(), max(0, due - now) / 1e9)

    def _expire(self, backlog: _Backlog) -> None:
        self._backlogs.remove(backlog)
        corrid = backlog.requests[0].corrid
        if self._backlog_of.get(corrid) is backlog:
            del self._backlog_of[corrid]
        for pending in backlog.requests:
            self._answer(pending, UnavailableError(_SEQUENCE_EXPIRED))

    # ---- failure and stop -------------------------------------------------------------------------------------

    async def _guard(self, work: Coroutine[Any, Any, None]) -> None:
        """Run one of the batcher's tasks; if it dies, fail every request the batcher holds."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave callers waiting forever
            self._fail(exc)
            raise

    def _fail(self, exc: Exception) -> None:
        logger.error("sequence batcher of model '%s' failed", self._name, exc_info=exc)
        self._failure = exc
        error = UnavailableError(f"the sequence batcher of model '{self._name}' failed: {exc}")
        for pending in list(self._held()):
            self._answer(pending, error)
        for runner in self._runners:
            for slot in runner.slots:
                slot.queue.clear()
        self._backlogs.clear()

    def _held(self) -> Iterator[Pending]:
        for runner in self._runners:
            yield from runner.pending()
        for backlog in self._backlogs:
            yield from backlog.requests

    async def stop(self) -> None:
        """Refuse new sequences, serve what is held (an idle sequence's slot frees after the idle time, so backlogged
        sequences get theirs), then release the instances."""
        self._stopping = True
        if self._failure is None:  # after a failure every request held was answered already
            await self._drained.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.pool.close)


def _sequence_span(entries: Sequence[Pending | None], index: int | None, corrid: SequenceId) -> tuple[int, int]:
    """Where the waiting requests of one sequence lie in a slot's queue or a backlog: around `index`, back to the
    sequence's START and on to its END (a queue may also hold a restarted sequence of the same id, or the reaper's
    mark); with `index` None (a request of it left the queue), the requests at the front that continue it."""
    if index is None:
        return 0, _span_end(entries, 0, 0, corrid)
    lo = _span_start(entries, index, corrid)
    return lo, _span_end(entries, lo, index + 1, corrid)


def _span_start(entries: Sequence[Pending | None], index: int, corrid: SequenceId) -> int:
    lo = index
    while lo > 0:
        current, before = entries[lo], entries[lo - 1]
        if current is None or current.start or before is None or before.corrid != corrid or before.end:
            break
        lo -= 1
    return lo


def _span_end(entries: Sequence[Pending | None], lo: int, hi: int, corrid: SequenceId) -> int:
    while hi < len(entries):
        after, last = entries[hi], entries[hi - 1] if hi > lo else None
        if after is None or after.corrid != corrid or after.start or (last is not None and last.end):
            break
        hi += 1
    return hi


def _cut(queue: deque[Pending | None], lo: int, hi: int) -> list[Pending]:
    """Remove `queue[lo:hi]`; the requests among them (not the reaper's mark)."""
    removed = [entry for entry in (queue[i] for i in range(lo, hi)) if entry is not None]
    for _ in range(hi - lo):
        del queue[lo]
    return removed


def _serves(config: ModelConfig) -> bool:
    return is_sequence_model(config)


def _build(parts: SchedulerParts) -> SequenceBatcher:
    settings = parts.sequence or SequenceSettings.from_config(parts.config, None)
    return SequenceBatcher(parts.config.name, settings, parts.instance_pool())


SCHEDULER_KIND = SchedulerKind("sequence_batching", _serves, _build)
