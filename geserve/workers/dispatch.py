"""The workers' front door: the supervisor accepts the native servers' connections and hands each one, as a file
descriptor over a Unix socket pair (SCM_RIGHTS), to the serving worker with the fewest open connections of its kind.

Why not SO_REUSEPORT alone: the kernel spreads connections by a hash of their addresses, blind to load. perf_analyzer's
16 HTTP connections landed 3:13, 5:11, 6:10, 11:5, 5:11 and 8:8 on two workers in six runs (measured), so one worker
did most of the work while the other idled; a gRPC client's few channels could all land on one. A hand-off costs one
accept and one sendmsg per connection, and nothing per request. The other servers (uvicorn, gRPC over TLS, which
grpc.aio serves) still share their ports with SO_REUSEPORT.

The worker reports each handed connection's close with one byte on the same pair; the supervisor keeps the counts,
stops accepting while no worker serves or every serving one is at the connection cap (new clients wait in the listen
backlog, as with one process), and forgets a worker's connections when it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass

from geserve.frontends.http.native_server import bind_listeners
from geserve.settings import ServerSettings

logger = logging.getLogger(__name__)

HANDOFF_VARIABLE = "GESERVE_WORKER_HANDOFF_FD"
HTTP, GRPC = b"h", b"g"  # a connection's kind: the one byte sent with its descriptor, and back when it closes
_NAMES = {HTTP: "HTTPService", GRPC: "GRPCInferenceService"}  # as the single-process servers log them
_SERVICES = {HTTP: "HTTP service", GRPC: "GRPC service"}  # as their start-up errors name them
_BACKLOG = 2048
_RECEIVE = 256  # close reports read at once
Adopter = Callable[[socket.socket, Callable[[], None]], None]  # serves a handed connection; calls back on its close


@dataclass(frozen=True, slots=True)
class Door:
    """A port the supervisor accepts on for the workers."""

    kind: bytes
    host: str
    port: int
    cap: float = math.inf  # most connections of this kind one worker holds


def doors(settings: ServerSettings) -> list[Door]:
    """The ports whose connections the workers take from the supervisor: those of the native servers (the worker
    decides alike from the same settings, and binds none of them)."""
    found = []
    if settings.allow_http and settings.http_server == "native":
        cap = settings.http_max_connections if settings.http_max_connections > 0 else math.inf
        found.append(Door(HTTP, settings.http_address, settings.http_port, cap))
    if settings.allow_grpc and settings.grpc_server == "native":  # cleartext or TLS: the worker adopts either
        found.append(Door(GRPC, settings.grpc_address, settings.grpc_port))
    return found


def handed_kinds(settings: ServerSettings) -> frozenset[bytes]:
    return frozenset(door.kind for door in doors(settings))


class Dispatcher:
    """Accepts on the doors once `open`, and hands the connections to the workers given `channel`s."""

    def __init__(self, door_list: list[Door]) -> None:
        self._doors = door_list
        self._listeners: list[tuple[Door, socket.socket]] = []
        self._channels: dict[int, socket.socket] = {}  # worker -> the supervisor's end of its pair
        self._open: dict[int, dict[bytes, int]] = {}  # worker -> kind -> connections it holds
        self._serving: set[int] = set()
        self._turn = itertools.count()  # ties go round the workers
        self._last: dict[int, int] = {}
        self._accepting: set[int] = set()  # listener descriptors being watched
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def kinds(self) -> frozenset[bytes]:
        return frozenset(door.kind for door in self._doors)

    def channel(self, index: int) -> socket.socket:
        """A new pair for worker `index` (started or restarted): the worker's end, to pass to its process."""
        self._drop(index)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self._channels[index] = ours
        self._open[index] = dict.fromkeys(self.kinds, 0)
        loop = self._loop = self._loop or asyncio.get_running_loop()  # kept: `_drop` must unwatch what it closes
        loop.add_reader(ours.fileno(), self._reports, index, ours)
        return theirs

    async def open(self) -> None:
        """Bind and listen on every door (an OSError names the service and the address, as one process's would)."""
        loop = self._loop = asyncio.get_running_loop()
        for door in self._doors:
            try:
                listeners = await bind_listeners(loop, door.host, door.port, _BACKLOG)
            except OSError as exc:
                raise OSError(exc.errno, f"failed to start the {_SERVICES[door.kind]}: unable to bind "
                                         f"{door.host}:{door.port} ({exc.strerror or exc})") from None
            self._listeners += [(door, listener) for listener in listeners]
            address = listeners[0].getsockname()
            logger.info("started %s at %s:%d (connections handed to the workers)", _NAMES[door.kind], door.host,
                        address[1])
        self._update()

    def serving(self, index: int, serving: bool) -> None:
        """Whether worker `index` takes connections now."""
        if serving and index in self._channels:
            self._serving.add(index)
        else:
            self._serving.discard(index)
        self._update()

    def close(self) -> None:
        """Stop accepting (the workers drain what they hold) and close the listeners and pairs."""
        self._serving.clear()
        self._update()
        for _, listener in self._listeners:
            listener.close()
        self._listeners = []
        for index in list(self._channels):
            self._drop(index)

    # ---- accepting -----------------------------------------------------------------------------------

    def _update(self) -> None:
        """Watch each listener while some serving worker has room for its kind; else leave clients in the backlog."""
        loop = self._loop
        if loop is None:
            return
        for door, listener in self._listeners:
            fd = listener.fileno()
            wanted = self._choose(door) is not None
            if wanted and fd not in self._accepting:
                loop.add_reader(fd, self._accept, door, listener)
                self._accepting.add(fd)
            elif not wanted and fd in self._accepting:
                loop.remove_reader(fd)
                self._accepting.discard(fd)

    def _choose(self, door: Door) -> int | None:
        """The serving worker with the fewest connections of the door's kind under the cap (ties: the one handed a
        connection longest ago)."""
        best: tuple[int, int] | None = None
        choice = None
        for index in self._serving:
            held = self._open[index][door.kind]
            if held >= door.cap:
                continue
            rank = (held, self._last.get(index, -1))
            if best is None or rank < best:
                best, choice = rank, index
        return choice

    def _accept(self, door: Door, listener: socket.socket) -> None:
        index = self._choose(door)
        if index is None:
            self._update()
            return
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # out of descriptors: the client waits in the backlog until one is free
            logger.warning("accepting a %s connection failed: %s", _NAMES[door.kind], exc.strerror or exc)
            self._pause_briefly(listener)
            return
        with connection:  # the worker has its own descriptor once sent: this one closes either way
            try:
                socket.send_fds(self._channels[index], [door.kind], [connection.fileno()])
            except OSError as exc:  # the worker is gone or stuck: the client sees its connection close
                logger.warning("handing a connection to worker %d failed: %s", index, exc.strerror or exc)
                return
        self._open[index][door.kind] += 1
        self._last[index] = next(self._turn)
        if self._open[index][door.kind] >= door.cap:
            self._update()

    def _pause_briefly(self, listener: socket.socket) -> None:
        loop = self._loop
        fd = listener.fileno()
        if loop is None or fd not in self._accepting:
            return
        loop.remove_reader(fd)
        self._accepting.discard(fd)
        loop.call_later(0.1, self._update)

    # ---- reports from the workers --------------------------------------------------------------------

    def _reports(self, index: int, channel: socket.socket) -> None:
        """Closes the worker reports, one byte each; end of file: the worker is gone, and its connections with it."""
        while True:
            try:
                data = channel.recv(_RECEIVE)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._drop(index)
                self._update()
                return
            counts = self._open.get(index)
            if counts is not None:
                for kind in data:
                    tag = bytes((kind,))
                    counts[tag] = max(0, counts.get(tag, 0) - 1)
        self._update()

    def _drop(self, index: int) -> None:
        self._serving.discard(index)
        channel = self._channels.pop(index, None)
        self._open.pop(index, None)
        if channel is not None:
            loop = self._loop
            if loop is not None:
                loop.remove_reader(channel.fileno())
            channel.close()


class Receiver:
    """A worker's end of its pair: adopts each connection handed to it with the server of its kind, and reports its
    close."""

    def __init__(self, channel: socket.socket, adopters: dict[bytes, Adopter]) -> None:
        self._channel = channel
        self._adopters = adopters
        channel.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(channel.fileno(), self._receive)

    def _receive(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._channel, 1, 1)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:  # the supervisor is gone (its link says so too)
                self.close()
                return
            for fd in fds:
                adopt = self._adopters.get(data)
                sock = socket.socket(fileno=fd)
                if adopt is None:  # a kind this worker does not serve: cannot happen with the same settings
                    sock.close()
                    self._closed(data)
                    continue
                adopt(sock, functools.partial(self._closed, data))

    def _closed(self, kind: bytes) -> None:
        with contextlib.suppress(OSError):  # the supervisor gone: nobody counts any more
            self._channel.send(kind)

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._channel.fileno())
        self._channel.close()
