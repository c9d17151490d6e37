"""A model's instances: each batch goes to the first free instance, on that instance's own worker thread.

Each instance owns one long-lived thread fed through a `queue.SimpleQueue`, and hands results back with
one `call_soon_threadsafe`: cheaper per request than `run_in_executor`'s executor and future chaining.
A model whose executions typically take less than `inline_below_us` of CPU runs on the event loop instead, if its
instances opt in with `inline_allowed` (the GE backend's CPU instances do; Python models, GPU and NPU instances do not:
they may wait, on calls back into the loop or on a device, and CPU time does not show a wait):
measured on 2 cores, handing a 60 µs MLP to a thread cost more than the run itself (GIL hand-offs and
wake-ups), and inline execution lifted it from ~2.8k to ~4k infer/s at concurrency 16. So does a run of up to 2 ms
while no request can arrive until it ends (geserve/arrivals.py): the loop would only wait for it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from geserve.arrivals import ARRIVALS
from geserve.backends.base import Execution, ModelInstance, Results
from geserve.devices import compute_priority
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest
from geserve.types.requests import expiry

logger = logging.getLogger(__name__)

READINESS_TIMEOUT_S = 5.0  # a model readiness check that takes longer answers "not ready"
# Inline runs whose CPU time is taken (one in this many) to keep `_typical_ns` current: reading a thread's CPU time is
# a system call (0.57 µs measured here), and an inline request took two. After a run that took longer than the inline
# limit on the wall clock, the next one is sampled too.
_SAMPLE_INLINE_EVERY = 8
# The longest typical run that goes inline while no request can arrive (ARRIVALS.closed): a batch of a small model whose
# every client waits on it. Measured with issue 15's MLP at c=16, 2 workers, 2000 µs delay: ~8% more throughput and
# ~15 µs less CPU per inference than the thread hand-off (GIL hand-off, futex and loop wake-ups) for batches of 8.
_CLOSED_INLINE_NS = 2_000_000
_RECENT_RUNS = 64  # executions kept in `recent_runs`
# A batch handed to a worker thread: its requests, the future its outcome goes to, and that future's loop.
_Job = tuple[list[InferenceRequest], asyncio.Future[Execution], asyncio.AbstractEventLoop]


class Worker:
    """One instance and the thread that runs its batches, one at a time."""

    def __init__(self, instance: ModelInstance, pool: InstancePool) -> None:
        self.instance = instance
        self.inline_allowed = instance.inline_allowed
        self._pool = pool
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # The execution running (monotonic ns when it started, its rows); (0, 0) while the instance is free.
        self.running: tuple[int, int] = (0, 0)
        self.thread = threading.Thread(target=self._serve, name=f"ge-{instance.name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        compute_priority.lower_this_thread()
        while (job := self.jobs.get()) is not None:
            requests, future, loop = job
            started = time.thread_time_ns()
            outcome = _execute(self.instance, requests)
            loop.call_soon_threadsafe(self._pool._finish, self, future, outcome, time.thread_time_ns() - started)
            # Idle until the next job: hold no reference to this batch's tensors meanwhile.
            del job, requests, future, outcome


def _rows(requests: list[InferenceRequest]) -> int:
    return sum(r.batch_size for r in requests)


def execution_failed(exc: Exception) -> GeserveError:
    """What the requests of a batch whose execution raised fail with: a bug's exception becomes UNAVAILABLE."""
    return exc if isinstance(exc, GeserveError) else UnavailableError(f"execution failed: {exc}")


def _execute(instance: ModelInstance, requests: list[InferenceRequest]) -> Execution | BaseException:
    try:
        return instance.execute(requests)
    except GeserveError as exc:
        return exc
    except Exception as exc:  # instances report failures as results: this is a bug, keep its traceback
        logger.exception("instance '%s' raised instead of returning errors", instance.name)
        return execution_failed(exc)
    except BaseException as exc:  # handed to the waiting request, never lost
        return exc


class InstancePool:
    def __init__(
        self,
        model_name: str,
        instances: Sequence[ModelInstance],
        statistics: ModelStatistics,
        inline_below_us: int = 0,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{model_name}' has no instances to execute on")
        self._statistics = statistics
        self._workers = [Worker(instance, self) for instance in instances]
        # Instances that check their own readiness (a Python model's `is_ready`); fixed once they are initialized.
        self._readiness_checks: list[Callable[[], bool]] = [i.is_ready for i in instances if i.checks_readiness]
        self._free: list[Worker] = list(reversed(self._workers))
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._woken = 0  # waiters woken for a free instance that have not yet taken it
        # Moving average of one execution's CPU time on the thread that runs it; decides where the next one runs.
        # CPU, not wall time: a run that a busy machine preempted is no reason to pay thread hand-offs after it.
        self._typical_ns = 0
        self._inline_runs = 0
        self._sample_next = False
        # Batches still running whose caller was cancelled: how each is counted once it finishes (`_finish`).
        self._orphans: dict[asyncio.Future[Execution], Callable[[Execution], Results]] = {}
        # The latest executions' rows and wall time from start to result, on the loop's clock (admission.py).
        self.recent_runs: collections.deque[tuple[int, int]] = collections.deque(maxlen=_RECENT_RUNS)
        self.inline_below_ns = inline_below_us * 1000

    @property
    def size(self) -> int:
        return len(self._workers)

    def fastest_run(self, rows: int) -> int:
        """The shortest wall time, start to result, of the latest executions of `rows` rows (0: none of them)."""
        return min((wall for ran, wall in self.recent_runs if ran == rows), default=0)

    def soonest_running(self) -> tuple[int, int]:
        """Of the executions running, the one that started first (when, in monotonic ns, and its rows): the first
        instance expected to be free. (0, 0) when an instance is free now, or none runs (taken for a batch that is
        still forming)."""
        if len(self._free) > self._woken:
            return 0, 0
        return min((worker.running for worker in self._workers if worker.running[0]), default=(0, 0))

    @property
    def has_free(self) -> bool:
        return len(self._free) > self._woken

    async def acquire(self) -> Worker:
        """The first free instance (waiting for one if all are busy); `run` hands it back when done. Waiters are
        served in order: a free instance that a woken waiter is about to take is not taken by a newcomer."""
        if len(self._free) > self._woken:
            return self._free.pop()  # the most recently used instance: its caches are warm
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        while True:
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken for an instance it will not take
                    self._woken -= 1
                    self._wake_next()
                raise
            self._woken -= 1
            if self._free:
                return self._free.pop()
            waiter = asyncio.get_running_loop().create_future()  # beaten to it: still first in line
            self._waiters.appendleft(waiter)

    async def run(
        self,
        worker: Worker,
        requests: list[InferenceRequest],
        enqueued_ns: list[int],
        padding_rows: int = 0,
        null_requests: int = 0,
    ) -> Results:
        """Execute `requests` as one batch on `worker`; the last `padding_rows` rows are gear padding. `null_requests`
        of them (one row each) fill a sequence batcher's empty slots: they count in the batch's size, as in Triton,
        but are no inferences of their own. The requests have started: their queue timeouts no longer hold."""
        started = time.monotonic_ns()
        worker.running = (started, _rows(requests))
        for request in requests:
            request.queue_deadline = None
        # Inline: a short run, or one no request can arrive during (the loop has nothing to read meanwhile) that is
        # short enough not to keep a new connection (a health probe) waiting.
        typical = self._typical_ns
        inline = worker.inline_allowed and typical > 0 and (
            typical <= self.inline_below_ns or (typical <= _CLOSED_INLINE_NS and ARRIVALS.closed())
        )
        ARRIVALS.executing += 1  # a model may send requests of its own while it runs (geserve/arrivals.py)
        try:
            if inline:
                execution = self._run_inline(worker, requests)
            else:
                loop = asyncio.get_running_loop()
                done: asyncio.Future[Execution] = loop.create_future()
                worker.jobs.put((requests, done, loop))
                try:
                    execution = await done
                except asyncio.CancelledError:
                    # The caller went away (a cancelled request) while the batch runs: it runs to its end all the
                    # same, and is counted then (`_finish`), as every execution is.
                    account = functools.partial(
                        self._account, requests, started, enqueued_ns, padding_rows, null_requests
                    )
                    if done.cancelled():
                        self._orphans[done] = account
                    elif done.exception() is None:  # it had finished, and the cancellation came before the result
                        account(done.result())
                    raise
        finally:
            ARRIVALS.executing -= 1
        return self._account(requests, started, enqueued_ns, padding_rows, null_requests, execution)

    def _run_inline(self, worker: Worker, requests: list[InferenceRequest]) -> Execution:
        """Shorter than a thread hand-off costs under the GIL: run it here, the loop stalls less than that."""
        self._inline_runs += 1
        if self._inline_runs % _SAMPLE_INLINE_EVERY and not self._sample_next:
            outcome = _execute(worker.instance, requests)
            if not isinstance(outcome, BaseException):
                compute = outcome.compute
                # Longer than the limit on the wall clock (slower, or preempted): the next run's CPU time is taken.
                self._sample_next = compute.input_ns + compute.infer_ns + compute.output_ns > self.inline_below_ns
        else:
            cpu_started = time.thread_time_ns()
            outcome = _execute(worker.instance, requests)
            self._note(time.thread_time_ns() - cpu_started)
            self._sample_next = False
        self.release(worker)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def runs_now(self) -> bool:
        """Whether `run_now` may be called: a free instance whose batches run on the loop (see `run`)."""
        return bool(self._free) and self._free[-1].inline_allowed and 0 < self._typical_ns <= self.inline_below_ns

    def run_now(self, requests: list[InferenceRequest]) -> Results:
        """`execute` without awaiting, where `runs_now` says so: the batch runs on the loop at once, unqueued."""
        worker = self._free.pop()
        started = time.monotonic_ns()
        ARRIVALS.executing += 1
        try:
            execution = self._run_inline(worker, requests)
        finally:
            ARRIVALS.executing -= 1
        return self._account(requests, started, [started], 0, 0, execution)

    def _account(
        self,
        requests: list[InferenceRequest],
        started: int,
        enqueued_ns: list[int],
        padding_rows: int,
        null_requests: int,
        execution: Execution,
    ) -> Results:
        """Record one finished execution in the statistics and the requests' compute times; its results."""
        compute = execution.compute
        batch_rows = _rows(requests)
        self.recent_runs.append((batch_rows, time.monotonic_ns() - started))
        rows = batch_rows - padding_rows
        count = len(requests) - (1 if padding_rows else 0) - null_requests
        # A request's queue time counts its wait for its model's load on demand (`waited_ns`) too. Not strict: a
        # sequence batch's null requests were never queued.
        queued_ns = [started - t + r.waited_ns for t, r in zip(enqueued_ns, requests, strict=False)]
        self._statistics.record_execution(
            count, rows - null_requests, queued_ns, compute.input_ns, compute.infer_ns, compute.output_ns,
            batch_size=rows,
        )
        for request in requests:
            if request.compute is not None:
                request.compute.add_times(compute)
            if request.trace is not None:  # a request the service traces: the times taken above, once per execution
                index = next(i for i, r in enumerate(requests) if r is request)  # not ==: requests hold arrays
                queued = enqueued_ns[index] if index < len(enqueued_ns) else started
                request.trace.executed(queued, started, time.monotonic_ns(), compute, requests)
        return execution.results

    async def execute(self, requests: list[InferenceRequest], enqueued_ns: list[int]) -> Results:
        """Run `requests` on the first free instance; a lone request whose deadline passed while it waited for one
        never starts."""
        worker = await self.acquire()
        gone = expiry(requests[0], time.monotonic()) if len(requests) == 1 else None
        if gone is not None:
            self.release(worker)
            return [gone]
        return await self.run(worker, requests, enqueued_ns)

    @property
    def checks_readiness(self) -> bool:
        return bool(self._readiness_checks)

    async def instances_ready(self, timeout_s: float = READINESS_TIMEOUT_S) -> bool:
        """Every instance's own readiness check (a Python model's `is_ready`), each on a helper thread: model code
        never runs on the loop, and a check may run while the instance executes, as Triton's stub allows."""
        checks = (asyncio.to_thread(check) for check in self._readiness_checks)
        try:
            results = await asyncio.wait_for(asyncio.gather(*checks), timeout_s)
        except asyncio.TimeoutError:  # not the builtin before 3.11
            return False
        return all(results)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return tuple(self._workers)

    def claim(self, worker: Worker) -> None:
        """Take this very instance off the free list (it must be free): for a scheduler that keeps each instance to
        itself, as the sequence batcher keeps a sequence on its instance; `run` hands it back as usual."""
        self._free.remove(worker)

    def take_free(self) -> Worker:
        """A free instance right now (check `has_free` first): no await between the check and the take."""
        return self._free.pop()

    def release(self, worker: Worker) -> None:
        """The instance is free again; the first waiter is woken to take it. Until that waiter runs, a request that
        runs at once on the loop (`run_now`) may use it: it gives it back before the waiter runs. Handing it to the
        waiter directly instead left it busy until then, so under steady load every new request queued behind the
        last, and none ran at once again (measured: half the requests of perf_analyzer's c=16 queued)."""
        worker.running = (0, 0)
        self._free.append(worker)
        self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._woken += 1
                return

    def _note(self, cpu_ns: int) -> None:
        typical = self._typical_ns
        # A sample counts for at most twice the typical run: on a VM, time the hypervisor took from the vCPU still
        # reads as the thread's CPU time, and a few such runs must not send the next ones through thread hand-offs
        # (which cost more CPU). A model that really got slower doubles the average within about six samples: inline
        # runs are sampled one in eight, and every other run while they take longer than the limit (`_run_inline`).
        self._typical_ns = cpu_ns if not typical else (7 * typical + min(cpu_ns, 2 * typical)) // 8

    def _finish(
        self, worker: Worker, done: asyncio.Future[Execution], outcome: Execution | BaseException, cpu_ns: int
    ) -> None:
        """On the loop: the worker is free again (even if its caller was cancelled), and the result delivered."""
        self._note(cpu_ns)
        self.release(worker)
        if done.done():  # its caller was cancelled (`run`): the execution is counted all the same
            account = self._orphans.pop(done, None)
            if account is not None and not isinstance(outcome, BaseException):
                account(outcome)
            return
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)

    def close(self) -> None:
        """Stop the worker threads after the batches they hold, then release the instances."""
        for worker in self._workers:
            worker.jobs.put(None)
        for worker in self._workers:
            worker.thread.join()
            worker.instance.finalize()
