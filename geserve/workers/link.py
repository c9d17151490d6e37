"""A worker's link to its supervisor: the `Cluster` its service uses (service/cluster.py), the calls the
supervisor makes on this worker (control calls, metrics, forwarded sequence requests, the server's readiness), and
the server's response cache, which every worker shares (service/shared_cache.py): when this worker joins, its
service's own cache gives way to the server's, and each control call tells that cache which loads it made."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from geserve.errors import InternalError
from geserve.ipc.peer import Peer
from geserve.repository.holder import LocalHolder
from geserve.repository.model import LoadedModel
from geserve.service.service import InferenceService
from geserve.service.shared_cache import SharedResponseCache, SharedTable
from geserve.types import InferenceRequest, InferenceResponse
from geserve.workers import budget
from geserve.workers.budget import BUDGET_CALLS
from geserve.workers.dispatch import HANDOFF_VARIABLE, Adopter, Receiver

logger = logging.getLogger(__name__)

SOCKET_VARIABLE = "GESERVE_WORKER_SOCKET"
INDEX_VARIABLE = "GESERVE_WORKER_INDEX"
COUNT_VARIABLE = "GESERVE_WORKER_COUNT"
CACHE_VARIABLE = "GESERVE_WORKER_CACHE_FD"  # the server's response cache segment, with --cache-config


class WorkerLink:
    """Connects to the supervisor's socket; `join` takes the server's control state (models loaded and unloaded,
    shared memory regions, log settings) before this worker serves."""

    def __init__(
        self, socket_path: str, index: int, count: int, handoff: socket.socket | None = None,
        cache_fd: int | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.handoff = handoff  # where the supervisor hands this worker its connections (workers/dispatch.py)
        self.cache_fd = cache_fd  # the server's response cache segment (service/shared_cache.py)
        self.cache: SharedResponseCache | None = None  # the service's cache once joined, with a segment
        self._models: Callable[[], list[LoadedModel]] | None = None
        self._holder: LocalHolder | None = None  # this worker's models, for the supervisor's memory budget
        self._receiver: Receiver | None = None
        self.index = index
        self.count = count  # workers in the server
        self._ready = False
        self._peer: Peer | None = None
        self._service: InferenceService | None = None
        self._metrics: Callable[[], bytes] = bytes
        self._watch: asyncio.Task[None] | None = None
        # How this worker stops (drains) when the supervisor says so or is gone. The server sets its own stop, not a
        # signal: a worker that already got one (systemd's SIGTERM to every process of the service) would take the
        # supervisor's as a second one and exit without draining. A SIGTERM only for a link used without a server.
        self.on_stop: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)

    @classmethod
    def from_environment(cls) -> WorkerLink | None:
        """The link of a process the supervisor started, None in a process started by hand."""
        path = os.environ.get(SOCKET_VARIABLE)
        if not path:
            return None
        handoff = os.environ.get(HANDOFF_VARIABLE)
        cache = os.environ.get(CACHE_VARIABLE)
        return cls(path, int(os.environ.get(INDEX_VARIABLE, "0")), int(os.environ.get(COUNT_VARIABLE, "1")),
                   socket.socket(fileno=int(handoff)) if handoff else None, int(cache) if cache else None)

    @property
    def ready(self) -> bool:
        return self._ready

    def shared_file(self, name: str) -> str:
        """A file the workers of this server run share (the trace ledger): in the supervisor's private folder, next
        to its socket, removed when the supervisor stops."""
        return os.path.join(os.path.dirname(self.socket_path), name)

    async def join(
        self, service: InferenceService, metrics: Callable[[], bytes],
        models: Callable[[], list[LoadedModel]] | None = None, holder: LocalHolder | None = None,
    ) -> None:
        """Connect, and receive the control calls the server has run so far (the supervisor replays them).
        `models`: the models this worker serves, by which the server's response cache learns which control call
        loaded each; without it, this worker keeps a cache of its own. `holder`: this worker's models as the
        server's memory budget and load on demand ask about them (workers/budget.py)."""
        self._service, self._metrics, self._holder = service, metrics, holder
        if models is not None:
            self._share_cache(service, models)
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        peer = self._peer = Peer(reader, writer, self._handle)
        peer.start()
        await peer.call("join", self.index, os.getpid())
        self._watch = asyncio.create_task(self._stop_with_supervisor(peer), name="worker-supervisor-watch")

    def _share_cache(self, service: InferenceService, models: Callable[[], list[LoadedModel]]) -> None:
        """The server's response cache replaces the service's own (the same `--cache-config` made both); the models
        loaded so far are those of this worker's start."""
        if self.cache_fd is None or service.response_cache is None:
            return
        table = SharedTable(self.cache_fd)  # a description of its own: the inherited one is not needed any more
        os.close(self.cache_fd)
        self.cache_fd, self._models = None, models
        self.cache = SharedResponseCache(table)
        self.cache.loaded_at_start(models())
        service.response_cache = self.cache

    def receive_connections(self, adopters: dict[bytes, Adopter]) -> None:
        """Serve the connections the supervisor hands over, each with the adopter of its kind."""
        if self.handoff is not None and self._receiver is None:
            self._receiver = Receiver(self.handoff, adopters)

    def serving(self) -> None:
        """This worker's frontends are up: the supervisor counts it in the server's readiness."""
        if self._peer is not None:
            self._peer.notify("serving", self.index)

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._watch is not None:
            self._watch.cancel()
        if self._peer is not None:
            await self._peer.close()

    async def broadcast(self, method: str, *args: Any) -> Any:
        return await self._connected().call("broadcast", self.index, method, args)

    async def gather(self, method: str, *args: Any) -> list[Any]:
        return list(await self._connected().call("gather", method, args))

    async def forward_sequence(self, request: InferenceRequest) -> InferenceResponse | None:
        return await self._connected().call("forward_sequence", self.index, request)

    async def demand(self, name: str) -> None:
        await self._connected().call("demand", name)

    def _connected(self) -> Peer:
        if self._peer is None:
            raise InternalError("this worker is not connected to its supervisor")
        return self._peer

    async def _handle(self, method: str, args: tuple[Any, ...]) -> Any:
        service = self._service
        assert service is not None
        if method == "control":
            return await self._control(service, *args)
        if method == "run_forwarded":
            return await service.run_forwarded(*args)
        if method == "metrics":
            return self._metrics()
        if method == "server_ready":
            self._ready = bool(args[0])
            return None
        if method == "stop":
            self.on_stop()
            return None
        raise InternalError(f"unknown call '{method}' from the supervisor")

    async def _control(
        self, service: InferenceService, method: str, args: tuple[Any, ...], number: int | None = None
    ) -> Any:
        """The server's control call `number` (the supervisor runs one at a time): the loads it makes are its, in
        the shared response cache's keys."""
        cache, models = self.cache, self._models
        if cache is None or models is None or number is None:
            return await self._run_control(service, method, args)
        cache.control_started(number)
        try:
            return await self._run_control(service, method, args)
        finally:
            cache.control_ended(models())

    async def _run_control(self, service: InferenceService, method: str, args: tuple[Any, ...]) -> Any:
        """The service runs control calls; this worker's holder answers the memory budget's."""
        if method not in BUDGET_CALLS:
            return await service.run_control(method, args)
        if self._holder is None:
            raise InternalError(f"'{method}': this worker was started without a model holder")
        return await budget.answer(self._holder, method, args)

    async def _stop_with_supervisor(self, peer: Peer) -> None:
        """A worker whose supervisor is gone (killed) drains and exits as on SIGTERM, rather than serve alone."""
        await peer.closed.wait()
        logger.warning("the supervisor is gone: this worker stops")
        self.on_stop()
