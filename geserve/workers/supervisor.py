"""`--workers N`: N worker processes serve the HTTP and gRPC ports and look like one server.

The supervisor serves no inference. It accepts the native servers' connections and hands each to the least busy
worker (dispatch.py); the other servers' ports the workers share with SO_REUSEPORT. It starts the workers (each a
`geserve serve` with the same options), runs the control calls one worker receives on all of them (model load /
unload, shared memory regions, log settings), gathers their statistics and metrics (it serves the metrics port
itself), tells them when all are ready, restarts a worker that dies (replaying the control calls the server ran,
so it comes back with the same models), and forwards a sequence's request to the worker that holds the sequence.
Models live in every worker (see docs/guide/workers.md and docs/design.md for the measurement behind that choice).
With `--cache-config`, it creates the server's response cache, a shared memory segment every worker maps
(service/shared_cache.py), and numbers its control calls, so that a load has the same number in every worker.

In poll mode the supervisor, not a worker, scans the repositories (repository/poller.py), once per interval, and
broadcasts what changed as `poll_load` / `poll_unload` control calls, kept and replayed like explicit loads: every
worker follows one scan, and none pays for its own. The supervisor because it outlives the workers: its record of
what it last saw does not restart with a worker (a restarted worker 0 would snapshot the disk afresh and never tell
the others of a change made while it was down), and it serves no requests for a scan to delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client.registry import CollectorRegistry

from geserve.devices.nvml import GpuCollector, load_nvml
from geserve.errors import GeserveError, InternalError
from geserve.frontends.metrics import MetricsOptions, MetricsService
from geserve.frontends.tls import TlsError, tls_files
from geserve.ipc.peer import Peer, PeerGone
from geserve.metrics.collector import BudgetCollector
from geserve.metrics.exposition import render
from geserve.metrics.system import CpuCollector, CpuSampler
from geserve.repository.budget import BudgetedFollower, pin_parameter, start_models
from geserve.repository.poller import ModelFollower, RepositoryPoller
from geserve.repository.store import ModelStore
from geserve.service.response_cache import CacheConfigError, build_response_cache
from geserve.service.shared_cache import create_segment
from geserve.settings import ServerSettings
from geserve.workers.budget import DEMAND_LOAD, EVICT, server_loads
from geserve.workers.dispatch import GRPC, HANDOFF_VARIABLE, HTTP, Dispatcher, doors
from geserve.workers.link import CACHE_VARIABLE, COUNT_VARIABLE, INDEX_VARIABLE, SOCKET_VARIABLE
from geserve.workers.metrics_merge import merge_expositions

logger = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 8
# Control calls that change the server's state: kept (the latest per model, per region) and replayed to a worker
# that joins later, so a restarted worker serves what the others serve.
_DECIDED = frozenset({"load_model", "unload_model"})  # through the server's decider, when it has one
_REPLAYED = frozenset({"load_model", "unload_model", "poll_load", "poll_unload", DEMAND_LOAD,
                       "register_shared_memory",
                       "unregister_shared_memory", "register_cuda_shared_memory", "unregister_cuda_shared_memory",
                       "log_settings", "trace_setting"})
_RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_STOP_GRACE_SECS = 10.0  # beyond --exit-timeout-secs, for a worker to unload its models and exit


def worker_count(requested: int) -> int:
    """`--workers`: as given; 0 (the default) is one per core this process may run on, at most MAX_AUTO_WORKERS."""
    if requested > 0:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_WORKERS))


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process | None = None
    peer: Peer | None = None
    serving: bool = False
    failures: int = 0
    started_at: float = 0.0


class Supervisor:
    """Runs `count` workers of `geserve serve <argv>` until signalled; `run` returns the exit status."""

    def __init__(self, settings: ServerSettings, argv: Sequence[str], count: int) -> None:
        self.settings = settings
        self.argv = list(argv)
        self.workers = [_Worker(i) for i in range(count)]
        self._replay: dict[tuple[str, str], tuple[str, tuple[Any, ...], int]] = {}  # with each call's number
        self._changes = itertools.count()
        self._calls = itertools.count(1)  # the control calls' numbers (0: the loads of a worker's start)
        self._held: list[socket.socket] = []
        self._control = asyncio.Lock()  # one control call of the server at a time, joins included
        self._stopping = False
        self._ready_sent: bool | None = None
        self._changed = asyncio.Event()
        self._cpu: CpuSampler | None = None
        self._machine = CollectorRegistry(auto_describe=False)  # the machine's families, sampled here once
        self._metrics: MetricsService | None = None
        self._folder = tempfile.TemporaryDirectory(prefix="geserve-workers-")  # mode 0700: ours alone
        self.socket_path = str(Path(self._folder.name) / "control.sock")
        self._dispatch = Dispatcher(doors(settings))
        polling = settings.model_control_mode == "poll"
        self._store = store = ModelStore(settings.model_repositories)
        # With a memory budget or load on demand, the supervisor decides every load and unload of the server and the
        # workers do them (workers/budget.py); the server is ready once the models of its start are loaded.
        self._loads = server_loads(settings, self)
        follower: ModelFollower = _EveryWorker(self)
        if self._loads is not None:
            follower = BudgetedFollower(self._loads, follower, settings.load_on_demand)
        self._poller = RepositoryPoller(store, follower, settings.repository_poll_secs) if polling else None
        self._starting = self._loads is not None and bool(settings.model_memory_budget)
        self._cache_fd = _cache_segment(settings)

    # ---- the life of the server --------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                logger.info("signal received, stopping the workers (a second signal kills them)")
                stop.set()
            else:
                self._kill_all()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        loop.add_signal_handler(signal.SIGHUP, self._reload_tls)
        server = await asyncio.start_unix_server(self._connected, path=self.socket_path)
        self._fix_ports()
        try:
            await self._start_metrics()  # first, as in a single process: /metrics answers once HTTP is live
            if not await self._start_all(stop):
                return 1
            try:  # the ports open once every worker serves, as one process binds after loading its models
                await self._dispatch.open()
            except OSError as exc:
                logger.error("%s", exc.strerror or exc)
                await self._stop_all([])
                return 1
            logger.info("serving with %d workers", len(self.workers))
            self._start_polling()
            watchers = [asyncio.create_task(self._watch(worker, stop)) for worker in self.workers]
            await stop.wait()
            return 0 if await self._stop_all(watchers) else 1
        finally:
            self._dispatch.close()
            server.close()
            for holder in self._held:
                holder.close()
            if self._metrics is not None:
                await self._metrics.stop()
            if self._cache_fd is not None:
                os.close(self._cache_fd)
            self._folder.cleanup()

    async def _start_all(self, stop: asyncio.Event) -> bool:
        """Start every worker and wait until all serve; one that exits first fails the start (as one process's
        failed start does), and the others are stopped."""
        await self._snapshot()
        for worker in self.workers:
            await self._spawn(worker)
        while not all(w.serving for w in self.workers):
            failed = [(w.index, w.process.returncode) for w in self.workers
                      if w.process is not None and w.process.returncode is not None]
            if failed or stop.is_set():
                for index, status in failed:
                    logger.error("worker %d exited with %s while starting", index, status)
                await self._stop_all([])
                return False
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.1)
        return await self._load_at_start()

    def _fix_ports(self) -> None:
        """Port 0 asks for any free port: one for all the workers, held (bound, never listening) by the supervisor
        so that it stays theirs."""
        settings = self.settings
        handed = self._dispatch.kinds  # the supervisor binds those itself
        for flag, port, wanted in (("--http-port", settings.http_port, settings.allow_http and HTTP not in handed),
                                   ("--grpc-port", settings.grpc_port, settings.allow_grpc and GRPC not in handed)):
            if wanted and port == 0:
                holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                holder.bind(("", 0))
                self._held.append(holder)
                self.argv += [flag, str(holder.getsockname()[1])]

    async def _spawn(self, worker: _Worker) -> None:
        channel = self._dispatch.channel(worker.index)
        environment = dict(os.environ, **{
            SOCKET_VARIABLE: self.socket_path,
            INDEX_VARIABLE: str(worker.index),
            COUNT_VARIABLE: str(len(self.workers)),
            HANDOFF_VARIABLE: str(channel.fileno()),
        })
        passed = [channel.fileno()]
        if self._cache_fd is not None:
            environment[CACHE_VARIABLE] = str(self._cache_fd)
            passed.append(self._cache_fd)
        worker.serving, worker.peer, worker.started_at = False, None, time.monotonic()
        # A session of its own: a terminal's Ctrl-C or hangup reaches the supervisor, which decides for the workers
        # (a worker still importing would die of a SIGHUP it cannot handle yet).
        try:
            worker.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "geserve", "serve", *self.argv, env=environment, start_new_session=True,
                pass_fds=passed,
            )
        finally:
            channel.close()  # the worker's end is the worker's
        logger.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    async def _watch(self, worker: _Worker, stop: asyncio.Event) -> None:
        """Restart the worker whenever it dies, until the server stops (after a pause that grows while it keeps
        dying young)."""
        while True:
            process = worker.process
            assert process is not None
            status = await process.wait()
            if self._stopping or stop.is_set():
                return
            self._set_serving(worker, False)
            lived = time.monotonic() - worker.started_at
            worker.failures = 0 if lived > 60 else worker.failures + 1
            delay = _RESTART_DELAYS[min(worker.failures, len(_RESTART_DELAYS) - 1)]
            logger.error("worker %d (pid %d) exited with %s; restarting it in %.1f s", worker.index, process.pid,
                         status, delay)
            await asyncio.sleep(delay)
            if self._stopping or stop.is_set():
                return
            await self._spawn(worker)

    async def _stop_all(self, watchers: list[asyncio.Task[None]]) -> bool:
        """Stop every worker (each drains as a single server does on SIGTERM), then wait; True when all exited 0.

        A joined worker is told over its link rather than signalled, so that one which also got the signal itself
        (systemd signals every process of the service's cgroup) does not count two signals and exit without
        draining."""
        self._stopping = True
        await self._stop_polling()
        self._dispatch.close()  # no new connections; the workers drain theirs
        self._send_ready()
        for worker in self.workers:
            _tell_to_stop(worker)
        deadline = self.settings.exit_timeout_secs + _STOP_GRACE_SECS
        processes = [w.process for w in self.workers if w.process is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)), deadline)
        except asyncio.TimeoutError:  # not the builtin before 3.11
            logger.warning("workers still running %.0f s after SIGTERM are killed", deadline)
            self._kill_all()
            await asyncio.gather(*(p.wait() for p in processes))
        for watcher in watchers:
            watcher.cancel()
        return all(p.returncode == 0 for p in processes)

    async def _snapshot(self) -> None:
        """Poll mode: what is on disk before the workers read any config, so a change while they load is seen."""
        if self._poller is not None:
            await self._poller.snapshot()

    def _start_polling(self) -> None:
        if self._poller is not None:
            self._poller.start()

    async def _stop_polling(self) -> None:
        """No load starts once stopping began."""
        if self._poller is not None:
            await self._poller.stop()

    def _kill_all(self) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    def _reload_tls(self) -> None:
        """SIGHUP: every worker re-reads its certificates, and so does the metrics endpoint. A worker still
        starting is left alone: it reads the files as they are now when it starts serving."""
        for worker in self.workers:
            if worker.peer is not None and worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGHUP)
        if self._metrics is not None and self._metrics.serves_tls:
            self._metrics.reload_tls()

    # ---- readiness -----------------------------------------------------------------------------------

    def _set_serving(self, worker: _Worker, serving: bool) -> None:
        worker.serving = serving
        self._dispatch.serving(worker.index, serving)
        self._changed.set()
        self._send_ready()

    def _send_ready(self) -> None:
        """Every worker answers ready only while all of them serve (and the server is not stopping)."""
        ready = not self._stopping and not self._starting and all(w.serving for w in self.workers)
        if ready != self._ready_sent:
            self._ready_sent = ready
            for worker in self.workers:
                if worker.peer is not None:
                    worker.peer.notify("server_ready", ready)

    # ---- calls from the workers ----------------------------------------------------------------------

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer: Peer | None = None

        async def handle(method: str, args: tuple[Any, ...]) -> Any:
            assert peer is not None
            return await self._handle(peer, method, args)

        peer = Peer(reader, writer, handle)
        peer.start()
        await peer.closed.wait()
        for worker in self.workers:
            if worker.peer is peer:
                worker.peer = None
                self._set_serving(worker, False)

    async def _handle(self, peer: Peer, method: str, args: tuple[Any, ...]) -> Any:
        if method == "join":
            return await self._join(peer, args[0])
        if method == "serving":
            self._set_serving(self.workers[args[0]], True)
            return None
        if method == "broadcast":
            return await self._broadcast(*args)
        if method == "gather":
            return await self._gather(*args)
        if method == "forward_sequence":
            return await self._forward_sequence(*args)
        if method == "demand" and self._loads is not None:
            return await self._loads.demand(*args)
        raise InternalError(f"unknown call '{method}' from a worker")

    async def _join(self, peer: Peer, index: int) -> None:
        """A worker that has loaded its initial models gets the control calls the server ran since it started,
        then takes part in every later one."""
        async with self._control:
            for method, args, number in list(self._replay.values()):
                try:
                    await peer.call("control", method, args, number)
                except GeserveError as exc:  # it failed on the others too when it ran (a bad config, say)
                    logger.info("worker %d: replayed %s failed: %s", index, method, exc.message)
            if self._loads is not None:  # what the models it now serves cost the server, for its index and statistics
                await peer.call("control", "budget_charges", (self._loads.charges(),))
            self.workers[index].peer = peer
        peer.notify("server_ready", bool(self._ready_sent))

    def _joined(self) -> list[tuple[int, Peer]]:
        return [(w.index, w.peer) for w in self.workers if w.peer is not None]

    async def _broadcast(self, origin: int, method: str, args: tuple[Any, ...]) -> Any:
        """One control call of the server: run on every worker at once; the worker it came to answers. A worker
        that fails where the first did not, fails the call with its reason; one that exits meanwhile is
        restarted with the call replayed. A model load or unload request goes through the server's decider first,
        when it has one (a memory budget: room is made before the load)."""
        if self._loads is not None and method in _DECIDED and self.settings.model_control_mode == "explicit":
            run = partial(self._run_everywhere, origin, method, args)
            if method == "unload_model":
                return await self._loads.unload(args[0], run)
            return await self._loads.load(args[0], run, pin_parameter(args[1]))
        return await self._run_everywhere(origin, method, args)

    async def _run_everywhere(self, origin: int, method: str, args: tuple[Any, ...]) -> Any:
        by_worker = await self._numbered(method, args)
        mine = by_worker.pop(origin, None)
        if isinstance(mine, BaseException):
            raise mine
        for index, result in by_worker.items():
            if isinstance(result, GeserveError) and not isinstance(result, PeerGone):
                raise type(result)(f"worker {index}: {result.message}")
        return mine

    async def _numbered(self, method: str, args: tuple[Any, ...]) -> dict[int, Any]:
        """A control call on every joined worker, under the next number (kept to replay if it changes what the
        server serves): each worker's result or exception, by worker."""
        async with self._control:
            joined = self._joined()
            number = next(self._calls)
            results = await asyncio.gather(
                *(peer.call("control", method, args, number) for _, peer in joined), return_exceptions=True
            )
            if method == EVICT:  # one unload per model it evicted
                for name in args[0]:
                    self._record("poll_unload", (name,), number)
            elif method in _REPLAYED:
                self._record(method, args, number)
        return dict(zip((index for index, _ in joined), results, strict=True))

    # The memory budget's view of the workers (workers/budget.py's `Workers`).

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.peer is not None and w.process is not None]

    async def everywhere(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return list((await self._numbered(method, args)).values())

    async def ask_each(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        answers = await asyncio.gather(*(peer.call("control", method, args) for _, peer in self._joined()),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, PeerGone):
                raise answer
        return [answer for answer in answers if not isinstance(answer, PeerGone)]

    async def _load_at_start(self) -> bool:
        """With a memory budget the workers load nothing at start: the supervisor loads the models of the start
        through the budget, measured, once every worker has joined (False: one failed, with --exit-on-error)."""
        if not self._starting or self._loads is None:
            return True
        failed = []
        for name in start_models(self.settings, await asyncio.to_thread(self._store.scan)):
            try:
                await self._loads.load(name, partial(self._run_everywhere, -1, "poll_load", (name,)))
            except GeserveError as exc:
                logger.error("model '%s' failed to load: %s", name, exc.message)
                failed.append(name)
        self._starting = False
        self._send_ready()
        if failed and self.settings.exit_on_error:
            await self._stop_all([])
            return False
        return True

    def _record(self, method: str, args: tuple[Any, ...], number: int) -> None:
        """Keep what a joining worker must replay: the latest call per model and per region, the log settings."""
        if method in ("load_model", "unload_model", "poll_load", "poll_unload", DEMAND_LOAD):
            key = ("model", args[0])
        elif method.startswith("unregister_") and not args[0]:  # every region of its kind
            kind = method.removeprefix("unregister_")
            calls = ("register_" + kind, "unregister_" + kind)
            for stale in [k for k, (m, _, _) in self._replay.items() if k[0] == "region" and m in calls]:
                del self._replay[stale]
            return
        elif method.endswith("shared_memory"):
            key = ("region", args[0])
        else:
            key = (method, str(next(self._changes)))  # settings: each change in turn, later ones override earlier
        self._replay.pop(key, None)
        self._replay[key] = (method, args, number)

    async def _gather(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return list(await asyncio.gather(*(peer.call("control", method, args) for _, peer in self._joined())))

    async def _forward_sequence(self, origin: int, request: Any) -> Any:
        """The worker that holds the request's sequence runs it; None when none does."""
        for index, peer in self._joined():
            if index != origin:
                with contextlib.suppress(PeerGone):
                    response = await peer.call("run_forwarded", request)
                    if response is not None:
                        return response
        return None

    # ---- metrics ---------------------------------------------------------------------------------------

    async def _start_metrics(self) -> None:
        """The metrics port is the supervisor's: every worker's families added up, and the CPU's once."""
        settings = self.settings
        if not settings.allow_metrics:
            return
        if settings.allow_cpu_metrics:
            sampler = CpuSampler()
            if sampler.available:
                self._cpu = sampler
                self._machine.register(CpuCollector(sampler))
        if settings.allow_gpu_metrics:
            nvml = load_nvml()  # None without nvidia-ml-py or a driver: no GPU families, as in Triton
            if nvml is not None:
                self._machine.register(GpuCollector(nvml))
        if self._loads is not None:  # the budget's families, once for the server: the supervisor decides
            self._machine.register(BudgetCollector(self._loads))
        try:
            tls = tls_files("--http", settings.http_use_ssl, settings.http_use_ssl_mutual,
                            settings.http_server_cert, settings.http_server_key, settings.http_root_cert)
        except TlsError as exc:  # the workers started with these files: only a change since then gets here
            raise OSError(str(exc)) from None
        address = settings.metrics_address or (settings.http_address if settings.allow_http else "0.0.0.0")
        options = MetricsOptions(address, settings.metrics_port, settings.metrics_interval_ms, tls)
        self._metrics = MetricsService(self._exposition, options, self._cpu)
        await self._metrics.start()

    async def _exposition(self) -> bytes:
        texts = await asyncio.gather(
            *(peer.call("metrics") for _, peer in self._joined()), return_exceptions=True
        )
        return merge_expositions([t.decode() for t in texts if isinstance(t, bytes)]) + render(self._machine)


def _tell_to_stop(worker: _Worker) -> None:
    """A running worker drains and exits: told over its link once joined, else signalled."""
    process = worker.process
    if process is None or process.returncode is not None:
        return
    if worker.peer is not None:
        worker.peer.notify("stop")
    else:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)


def _cache_segment(settings: ServerSettings) -> int | None:
    """The server's response cache (`--cache-config`), for the workers to share; None without one, or with settings
    the workers will refuse to start with (each says why, as one process would)."""
    try:
        cache = build_response_cache(settings.cache_config)
    except CacheConfigError:
        return None
    return None if cache is None else create_segment(cache.capacity)


class _EveryWorker:
    """Poll mode: what the supervisor's scan found changed, loaded or unloaded on every worker (and replayed to one
    that joins later); a worker's failure fails the load with its reason, which the poller reports."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    async def load(self, name: str) -> None:
        await self._supervisor._run_everywhere(-1, "poll_load", (name,))  # -1: no worker asked

    async def unload(self, name: str) -> None:
        await self._supervisor._run_everywhere(-1, "poll_unload", (name,))
