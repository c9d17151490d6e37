"""The sequence batcher's two strategies, each a runner per model instance that owns that instance's sequence slots.

`direct` (Triton's DirectSequenceBatch): a sequence keeps one slot, and a batch holds a row per slot, slot 0 up to
the highest one with a request; an empty slot gets a null request (READY false) so every sequence stays in its row.
A batch goes at once, or, with `max_queue_delay_microseconds` and `minimum_slot_utilization`, once enough slots are
ready or the oldest request has waited long enough. The next batch is formed once the last one has finished.

`oldest` (Triton's OldestSequenceBatch): each slot sends its sequence's next request once the previous one is done,
and a small dynamic batcher on the instance forms batches of those: the largest preferred size at once, else what
there is once the oldest has waited `max_queue_delay_microseconds`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from geserve.config.sequence import SequenceSettings
from geserve.scheduling.pool import InstancePool, Worker, execution_failed
from geserve.scheduling.sequence_requests import SequenceId, SequenceInputs, SequenceState
from geserve.types import InferenceRequest, InferenceResponse


@dataclass(eq=False, slots=True)
class Pending:
    """A request of a sequence waiting in a slot or the backlog, with its future and its sequence flags."""

    request: InferenceRequest
    future: asyncio.Future[InferenceResponse]
    enqueued_ns: int
    corrid: SequenceId
    start: bool
    end: bool
    answered: bool = False


# In a slot's queue, after an idle sequence's last request: the reaper's mark that the slot is free from there on.
FORCE_END = None


@dataclass(eq=False, slots=True)
class Slot:
    """One sequence slot of one instance: its queue, the sequence it serves and that sequence's state."""

    runner: Runner
    index: int
    queue: collections.deque[Pending | None] = field(default_factory=collections.deque)
    corrid: SequenceId | None = None
    state: SequenceState | None = None
    in_flight: bool = False  # oldest: its sequence has a request issued and not yet done


@dataclass(eq=False, slots=True)
class Item:
    """A request taken from its slot to run: the copy its instance gets, and the state its outputs update."""

    pending: Pending
    slot: Slot
    request: InferenceRequest
    state: SequenceState | None
    issued_ns: int


class SlotOwner(Protocol):
    """The sequence batcher as its runners see it."""

    settings: SequenceSettings
    inputs: SequenceInputs
    pool: InstancePool

    def release_slot(self, slot: Slot) -> bool:
        """The slot's sequence has ended: give it the next backlogged sequence (True) or make it free (False)."""
        ...

    def finish(self, item: Item, result: InferenceResponse | BaseException) -> None:
        """Deliver the outcome of a request that ran (its state updated on success)."""
        ...


class Runner:
    """One instance and its slots; `serve` forms and runs its batches, one at a time, until cancelled."""

    def __init__(self, owner: SlotOwner, worker: Worker, index: int) -> None:
        self.owner = owner
        self.worker = worker
        self.index = index
        self.slots = [Slot(self, i) for i in range(owner.settings.slots_per_instance)]
        self.executing: list[Item] = []
        self._wake = asyncio.Event()

    def enqueue(self, slot: Slot, entry: Pending | None) -> None:
        raise NotImplementedError

    async def serve(self) -> None:
        raise NotImplementedError

    def pending(self) -> Iterator[Pending]:
        """Every request this runner holds and has not answered (its task died: they are failed)."""
        for slot in self.slots:
            yield from (entry for entry in slot.queue if entry is not None)
        yield from (item.pending for item in self.executing)

    def withdraw(self, pending: Pending) -> Item | None:
        """Take back a request taken from its slot but not yet in a batch (its caller was cancelled), then `resume`
        its slot; None when it is in no such place (direct: a request taken from its slot is running)."""
        return None

    def resume(self, slot: Slot) -> None:
        """Go on with `slot` after a withdrawn request: what the end of that request's batch would have done."""

    def prepare(self, pending: Pending, slot: Slot) -> Item:
        """Take `pending` to run in `slot`: a START (or a slot with no state yet) begins from the initial state."""
        inputs = self.owner.inputs
        if inputs.has_state and (pending.start or slot.state is None):
            slot.state = inputs.initial_state()
        state = slot.state if inputs.has_state else None
        request = inputs.execution(pending.request, pending.start, pending.end, pending.corrid, state)
        return Item(pending, slot, request, state, time.monotonic_ns())

    def shape_key(self, pending: Pending, slot: Slot) -> tuple[object, ...]:
        """Requests run together only with the same inputs of the same shapes past the batch axis, states included."""
        state = None if pending.start else slot.state
        inputs = tuple([(t.name, t.shape[1:]) for t in pending.request.inputs])
        return inputs + self.owner.inputs.state_shapes(state) if self.owner.inputs.has_state else inputs

    async def _run(self, entries: list[Item | None]) -> None:
        """Run one batch in slot order (None: a null request) and deliver each real request's outcome."""
        items = [e for e in entries if e is not None]
        self.executing = items
        try:
            like = items[0].request
            requests = [e.request if e is not None else self.owner.inputs.null(like) for e in entries]
            pool = self.owner.pool
            pool.claim(self.worker)
            try:
                queued = [i.pending.enqueued_ns for i in items]
                nulls = len(entries) - len(items)
                results: list[InferenceResponse | BaseException] = list(
                    await pool.run(self.worker, requests, queued, null_requests=nulls)
                )
            except Exception as exc:
                results = [execution_failed(exc)] * len(entries)
        finally:
            self.executing = []
        for entry, result in zip(entries, results, strict=True):
            if entry is not None:
                self.owner.finish(entry, result)

    async def _wait(self, timeout_s: float | None = None) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):  # not the builtin before 3.11
            await asyncio.wait_for(self._wake.wait(), timeout_s)


class DirectRunner(Runner):
    """Triton's direct strategy on one instance (see the module docstring)."""

    def __init__(self, owner: SlotOwner, worker: Worker, index: int) -> None:
        super().__init__(owner, worker, index)
        self._max_active = -1  # the highest slot that serves a sequence
        self._batch_limit = max(1, owner.settings.max_batch_size)

    def enqueue(self, slot: Slot, entry: Pending | None) -> None:
        slot.queue.append(entry)
        self._max_active = max(self._max_active, slot.index)
        self._wake.set()

    async def serve(self) -> None:
        while True:
            batch = await self._next_batch()
            await self._run(batch)

    async def _next_batch(self) -> list[Item | None]:
        while True:
            key, ready, last, earliest = self._scan()
            if last < 0:
                self._shrink()
                await self._wait()
                continue
            fill_s = self._fill_wait_s(ready, earliest)
            if fill_s is not None:
                await self._wait(fill_s)
                continue
            assert key is not None
            return self._collect(last, key)

    def _scan(self) -> tuple[tuple[object, ...] | None, int, int, int]:
        """Free the slots the reaper marked, then look at the front of each active slot: the first ready request's
        shape key, how many slots are ready, the highest ready one (-1: none) and the oldest ready request's time."""
        key: tuple[object, ...] | None = None
        ready, last, earliest = 0, -1, 0
        for slot in self.slots[: self._max_active + 1]:
            queue = slot.queue
            if queue and queue[0] is FORCE_END:
                queue.popleft()
                self.owner.release_slot(slot)  # a backlogged sequence may take it over, and run at once
            if not queue:
                continue
            front = queue[0]
            assert front is not None  # a slot's queue ends at its mark: a refill never holds one
            if key is None:
                key = self.shape_key(front, slot)
            earliest = min(earliest, front.enqueued_ns) if ready else front.enqueued_ns
            ready += 1
            last = slot.index
        return key, ready, last, earliest

    def _fill_wait_s(self, ready: int, earliest: int) -> float | None:
        """How long to wait for more slots to be ready (`minimum_slot_utilization`); None: the batch goes now."""
        settings = self.owner.settings
        delay, utilization = settings.max_queue_delay_ns, settings.minimum_slot_utilization
        if not (delay and utilization):
            return None
        waited = time.monotonic_ns() - earliest
        if waited <= delay and ready / self._batch_limit < utilization:
            return (delay - waited) / 1e9
        return None

    def _collect(self, last: int, key: tuple[object, ...]) -> list[Item | None]:
        """A request from each slot up to `last`; a null request where a slot has none (or one of other shapes)."""
        entries: list[Item | None] = []
        for slot in self.slots[: last + 1]:
            queue = slot.queue
            front = queue[0] if queue else None
            if front is None or self.shape_key(front, slot) != key:
                entries.append(None)
                continue
            entries.append(self.prepare(front, slot))
            queue.popleft()  # only once prepared: a request is always where a failure can find it
            if front.end:
                self.owner.release_slot(slot)
        self._shrink()
        return entries

    def _shrink(self) -> None:
        while self._max_active >= 0 and self.slots[self._max_active].corrid is None:
            self._max_active -= 1


class OldestRunner(Runner):
    """Triton's oldest strategy on one instance (see the module docstring)."""

    def __init__(self, owner: SlotOwner, worker: Worker, index: int) -> None:
        super().__init__(owner, worker, index)
        self._issued: collections.deque[Item] = collections.deque()  # what the slots sent, oldest first
        self._limit = max(1, owner.settings.max_batch_size)

    def pending(self) -> Iterator[Pending]:
        yield from super().pending()
        yield from (item.pending for item in self._issued)

    def withdraw(self, pending: Pending) -> Item | None:
        for item in self._issued:
            if item.pending is pending:
                self._issued.remove(item)
                return item
        return None

    def resume(self, slot: Slot) -> None:
        self._advance(slot)

    def enqueue(self, slot: Slot, entry: Pending | None) -> None:
        slot.queue.append(entry)
        if not slot.in_flight:
            self._advance(slot)

    def _advance(self, slot: Slot) -> None:
        """Triton's CompleteAndNext: issue the slot's next request, releasing the slot after an END or the reaper's
        mark (a backlogged sequence taking it over starts once nothing of the old one is in flight)."""
        while True:
            slot.in_flight = False
            release = False
            if slot.queue:
                entry = slot.queue[0]
                if entry is FORCE_END:
                    release = True
                else:
                    release = entry.end
                    self._issued.append(self.prepare(entry, slot))
                    slot.in_flight = True
                    self._wake.set()
                slot.queue.popleft()
            if release and self.owner.release_slot(slot) and not slot.in_flight:
                continue
            return

    async def serve(self) -> None:
        while True:
            if not self._issued:
                await self._wait()
                continue
            batch = await self._next_batch()
            if not batch:
                continue
            await self._run(list(batch))
            for item in batch:
                self._advance(item.slot)

    async def _next_batch(self) -> list[Item]:
        settings = self.owner.settings
        while self._issued:
            first = self._issued[0]
            candidate = self._candidates(first)
            preferred = max((size for size in settings.preferred_batch_sizes if size <= len(candidate)), default=0)
            full = len(candidate) >= self._limit
            waited = time.monotonic_ns() - first.issued_ns
            if not full and not preferred and waited < settings.max_queue_delay_ns:
                await self._wait((settings.max_queue_delay_ns - waited) / 1e9)
                continue
            if not full and preferred:
                candidate = candidate[:preferred]
            self._take(candidate)
            return candidate
        return []

    def _candidates(self, first: Item) -> list[Item]:
        """The issued requests that can run with `first` (same shapes), oldest first, up to the batch limit."""
        key = self._key(first)
        return [item for item in self._issued if self._key(item) == key][: self._limit]

    def _take(self, batch: list[Item]) -> None:
        taken = {id(item) for item in batch}
        self._issued = collections.deque(item for item in self._issued if id(item) not in taken)

    @staticmethod
    def _key(item: Item) -> tuple[object, ...]:
        return tuple([(t.name, t.shape[1:]) for t in item.request.inputs])
