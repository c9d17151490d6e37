"""An isolated Python model instance: the ModelInstance the server's pool drives, whose model runs in a process of
its own (isolation/process.py), restarted when that process dies.

A native crash (os.abort(), SIGSEGV, the OOM killer) fails only the requests the process held, each answered with an
error; requests that reach the instance while it restarts wait for the new process, and the model's readiness is
false until it serves. Restarts back off (RESTART_DELAYS_S) while they keep failing, answering at once meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from geserve.backends.base import Execution, InferenceHost, ModelInstance, Results
from geserve.backends.python.isolation.process import START_TIMEOUT_S, ModelProcess, how_it_ended
from geserve.backends.python.isolation.remote import request_fields
from geserve.backends.python.isolation.session import Session
from geserve.backends.python.isolation.spares import Spares
from geserve.backends.python.metrics import MetricStore
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.ipc.lane import NotSent
from geserve.ipc.peer import PeerGone
from geserve.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

RESTART_DELAYS_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # before each of the consecutive restarts that failed
HEALTHY_AFTER_S = 60.0  # a process that served this long starts the count of failed restarts afresh
FINALIZE_TIMEOUT_S = 30.0  # the model's finalize() (it may join its threads) before its process is ended anyway
READY_TIMEOUT_S = 5.0
STOP_WAIT_S = 2.0  # how long an execution whose process died waits to learn how it ended


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance's process needs to create it: the model file, its names, outputs and initialize() args."""

    name: str
    model_name: str
    path: str
    outputs: list[str]
    decoupled: bool
    args: dict[str, str]


@dataclass
class _Running:
    process: ModelProcess
    session: Session
    checks_readiness: bool
    started: float = field(default_factory=time.monotonic)
    # The process that replaces this one once it ended (or why none could): for executions that took this one
    # between its end and the start of its restart.
    successor: concurrent.futures.Future[_Running] = field(default_factory=concurrent.futures.Future)


class IsolatedInstance(ModelInstance):
    inline_allowed = False  # execute waits on another process

    def __init__(self, spec: InstanceSpec, host: InferenceHost, store: MetricStore, spares: Spares) -> None:
        loop = host.loop
        if loop is None or loop.is_closed():
            raise UnavailableError(f"Python model instance '{spec.name}' needs a running server for its process")
        self.name = spec.name
        self._spec = spec
        self._host = host
        self._store = store
        self._spares = spares
        self._loop = loop
        self._current: concurrent.futures.Future[_Running] = concurrent.futures.Future()
        self._closing = False
        self._failed_restarts = 0  # in a row: how long the next restart waits
        self._dead: _Running | None = None  # the process being replaced, while a restart is under way
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- life cycle (called from threads other than the loop's) -------------------------------------------------

    def initialize(self) -> None:
        """Start the first process and initialize the model in it; raise the model's fault if it fails."""
        running = asyncio.run_coroutine_threadsafe(self._launch(), self._loop).result()
        self._current.set_result(running)
        self._loop.call_soon_threadsafe(self._keep, self._watch(running))

    @property
    def checks_readiness(self) -> bool:
        return True  # the process must be alive, whether or not the model has an is_ready()

    def is_ready(self) -> bool:
        running = self._serving_now()
        if running is None:
            return False
        if not running.checks_readiness:
            return True
        try:
            return bool(running.process.channel.call_threadsafe("is_ready").result(READY_TIMEOUT_S))
        except (GeserveError, TimeoutError):
            return False

    def finalize(self) -> None:
        self._closing = True
        try:
            future = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        except RuntimeError:  # the loop is gone (an abrupt exit): the process must not outlive the server
            running = self._serving_now()
            if running is not None:
                running.process.kill()
            return
        future.result()

    # ---- execution ----------------------------------------------------------------------------------------------

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        started = time.monotonic_ns()
        try:
            results = self._run(self._serving(), requests, again=True)
        except GeserveError as exc:
            results = self._failed(requests, exc)
        return Execution.timed(results, started)

    def _run(self, running: _Running, requests: list[InferenceRequest], again: bool) -> Results:
        """The batch's results from `running`'s process. A batch that process never saw (it had ended before the
        batch could be sent) runs `again` on the process its restart brings, unless decoupled (its streams ended
        with the process)."""
        session = running.session
        keys = [session.hold(request) for request in requests]
        try:
            batch = [request_fields(key, request) for key, request in zip(keys, requests, strict=True)]
            return running.process.lane.call("execute", batch)
        except NotSent:
            if not again or self._spec.decoupled:
                return self._failed(requests, self._lost(running, running.process.poll(STOP_WAIT_S)))
            successor = self._awaited(running.successor)
        except PeerGone:
            return self._failed(requests, self._lost(running, running.process.poll(STOP_WAIT_S)))
        except GeserveError as exc:
            return self._failed(requests, exc)
        finally:
            if not self._spec.decoupled:  # a decoupled request is held until its final response
                for key in keys:
                    session.let_go(key)
        return self._run(successor, requests, again=False)

    def _serving_now(self) -> _Running | None:
        current = self._current
        if not current.done() or current.exception() is not None:
            return None
        running = current.result()
        return None if running.process.ended.is_set() else running

    def _serving(self) -> _Running:
        """The process to run on, waiting for one that is starting; UnavailableError while restarts fail."""
        running = self._awaited(self._current)
        if running.process.ended.is_set():  # it just ended: the one its restart brings
            running = self._awaited(running.successor)
        return running

    def _awaited(self, process: concurrent.futures.Future[_Running]) -> _Running:
        """The process `process` brings once started; its error (UnavailableError) where restarts fail."""
        try:
            return process.result(START_TIMEOUT_S)
        except TimeoutError:
            raise UnavailableError(f"Python model instance '{self.name}' has no process: its start is taking "
                                   f"more than {START_TIMEOUT_S:.0f} s") from None

    def _failed(self, requests: list[InferenceRequest], error: GeserveError) -> Results:
        """Every request failed with `error`; a decoupled one on its stream, as the in-process instance does."""
        if not self._spec.decoupled:
            return [error] * len(requests)
        for request in requests:
            if request.stream is not None:
                request.stream.fail(error)
        return [InferenceResponse(r.model_name, r.model_version, [], r.id) for r in requests]

    def _lost(self, running: _Running, status: int | None) -> InternalError:
        """What the requests a dead process held are answered: Triton's words for a dead stub, then what happened."""
        return InternalError(
            f"Stub process '{self.name}' is not healthy. Its process (pid {running.process.pid}) "
            f"{how_it_ended(status)} while it held the request; it is being restarted."
        )

    # ---- on the loop: start, watch, restart, close ----------------------------------------------------------------

    def _keep(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _launch(self) -> _Running:
        spec = self._spec
        started = self._spares.take(spec.path, spec.name)  # the process that ran auto-complete, if still there
        if started is None:
            session = Session(spec.name, self._host, self._store)
            process = await ModelProcess.start(spec.name, session.handle)
            session.channel, session.pid = process.channel, process.pid
        else:
            process, session = started.process, started.session
        try:
            checks = await process.channel.call("initialize", spec.path, spec.model_name, spec.name, spec.outputs,
                                                spec.decoupled, spec.args)
        except BaseException as exc:
            status = await process.stop()
            session.end(UnavailableError(f"Python model instance '{spec.name}' failed to start"))
            if isinstance(exc, PeerGone):
                raise InternalError(f"failed to initialize Python model instance '{spec.name}': its process "
                                    f"{how_it_ended(status)}") from None
            raise
        logger.info("Python model instance '%s' runs in process %d", spec.name, process.pid)
        return _Running(process, session, bool(checks))

    async def _watch(self, running: _Running) -> None:
        await running.process.ended.wait()
        status = await running.process.wait()
        if self._closing:
            return
        lived = time.monotonic() - running.started
        logger.error("the process of Python model instance '%s' (pid %d) %s after %.1f s: restarting it", self.name,
                     running.process.pid, how_it_ended(status), lived)
        running.session.end(self._lost(running, status))
        await running.process.stop()  # its lane and channel released now, not whenever the collector gets to them
        self._dead = running
        if lived >= HEALTHY_AFTER_S:
            self._failed_restarts = 0
        self._current = concurrent.futures.Future()
        await self._restart(running)

    async def _restart(self, dead: _Running) -> None:
        """Start processes until one serves, backing off while they fail; meanwhile executions fail at once."""
        while not self._closing:
            await asyncio.sleep(RESTART_DELAYS_S[min(self._failed_restarts, len(RESTART_DELAYS_S) - 1)])
            if self._current.done():
                self._current = concurrent.futures.Future()
            attempt = self._current
            outcome: _Running | GeserveError
            try:
                outcome = await self._launch()
            except GeserveError as exc:
                self._failed_restarts += 1
                outcome = UnavailableError(f"Python model instance '{self.name}' is restarting: its process ended "
                                           f"and restart {self._failed_restarts} failed: {exc.message}")
                logger.error("%s", outcome.message)
            _settle(attempt, outcome)
            _settle(dead.successor, outcome)
            if isinstance(outcome, _Running):
                self._dead = None
                self._keep(self._watch(outcome))
                return

    async def _close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a restart under way ends its process first
        unloaded = UnavailableError(f"Python model instance '{self.name}' was unloaded")
        for waited in (self._current, *((self._dead.successor,) if self._dead is not None else ())):
            _settle(waited, unloaded)  # nobody waits for a restart that will not come
        current = self._current
        if current.exception() is not None:
            return
        running = current.result()
        if not running.process.ended.is_set():
            try:
                await asyncio.wait_for(running.process.channel.call("finalize"), FINALIZE_TIMEOUT_S)
            except (GeserveError, TimeoutError) as exc:
                logger.warning("finalize() of Python model instance '%s' did not complete: %s", self.name, exc)
        await running.process.stop()
        running.session.end(UnavailableError(
            f"the Python model instance '{self.name}' was unloaded before it sent its final response"))


def _settle(future: concurrent.futures.Future[_Running], outcome: _Running | GeserveError) -> None:
    """The outcome of a start, to whoever waits on `future` (once: a later one does not change it)."""
    if future.done():
        return
    if isinstance(outcome, GeserveError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
