"""A lean HTTP/1.1 server for ASGI apps, on httptools and the server's own event loop.

Written here because uvicorn spent ~100 µs of CPU per request on its ASGI plumbing where this spends ~30
(measured on a trivial app): for small models that is most of the served latency. It does what the
inference protocol needs: keep-alive, pipelining (answered in order), Content-Length and chunked request
bodies, `Expect: 100-continue`, a body-size limit enforced while reading, and a graceful stop. A client that
repeats one kind of request gets its head replayed rather than parsed again (replay.py). Each connection is a state
machine that reads requests and a responder that answers them in order (connection.py); this module accepts the
connections, keeps their limits and times them out.

Connection limits (`HttpLimits`, the --http-* flags) keep slow, idle and hostile clients from holding the
server: a header-read timeout, an idle keep-alive timeout and a body-progress timeout (408), a cap on header
size and count (431), and a cap on open connections. The timeouts cost a request nothing but a few attribute
stores: each connection records its state and when it entered it on a coarse clock, and one periodic sweep
(at most every second) closes the connections whose state has lasted too long. The server accepts its own
connections, so that at the connection cap, or when file descriptors run out, it can stop accepting and
leave new connections waiting in the listen backlog rather than refusing them (see `_accept`).

HTTPS (`tls`, a frontends.tls.ServerTls): each accepted socket is wrapped with the endpoint's current SSLContext,
so a certificate reloaded on SIGHUP serves the next connections while the open ones keep theirs. The TLS
handshake counts against the header timeout (it bounds the handshake); the client certificate's subject (mutual
TLS) is read once per connection and reaches the app in the ASGI TLS extension (scope["extensions"]["tls"]). A
plaintext server pays nothing for this but one attribute test per request.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geserve.frontends.http.connection import HttpConnection, State
from geserve.frontends.http.messages import DirectApp, Request
from geserve.frontends.tls import ServerTls

logger = logging.getLogger(__name__)

_ACCEPT_RETRY_FIRST, _ACCEPT_RETRY_MAX = 0.05, 1.0  # seconds before accepting again when descriptors ran out
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_WARN_EVERY = 10.0  # seconds between two warnings of the same kind (a flood must not flood the log)
_Connection = HttpConnection  # the name bench/http_path_bench.py imports


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP client may hold of the server (the --http-* flags; 0 turns a limit off)."""

    header_timeout: float = 15.0
    """Seconds a request's line and headers may take from its first byte (a new connection's: from connecting)."""
    idle_timeout: float = 60.0
    """Seconds a keep-alive connection may wait, with no request under way, for its next request."""
    body_timeout: float = 30.0
    """Seconds a request body may go without a byte arriving."""
    max_header_size: int = 64 * 1024
    """Largest request line plus headers, in bytes."""
    max_header_count: int = 100
    """Most header fields in one request."""
    max_connections: int = 1024
    """Most connections open at once; further ones wait in the listen backlog."""


class NativeHttpServer:
    """Serves one ASGI app on host:port within `limits`; `started`, `serve()` and `should_exit` mirror
    uvicorn.Server."""

    def __init__(
        self, app: Any, host: str, port: int, max_body_size: int, limits: HttpLimits | None = None,
        tls: ServerTls | None = None, reuse_port: bool = False, adopting: bool = False,
    ) -> None:
        self.app = app
        self.direct: DirectApp | None = app if isinstance(app, DirectApp) else None
        # A connection replays a repeated request head (replay.py) unless the app's shortcuts are off.
        self.replay = self.direct is not None and self.direct.shortcuts
        self.tls = tls
        self.reuse_port = reuse_port  # several worker processes share the port (--workers)
        self.adopting = adopting  # binds nothing: serves the connections handed to `adopt` (--workers)
        self.host = host
        self.port = port
        self.max_body_size = max_body_size
        self.limits = limits = limits or HttpLimits()
        self.connections: set[HttpConnection] = set()
        self.inflight = 0
        self.started = False
        self.stopping = False
        self._stop = asyncio.Event()
        self._server_address: tuple[str, int] | None = None
        # Read by every request: plain attributes, with "off" (0) already turned into "no limit".
        self.max_header_size = limits.max_header_size if limits.max_header_size > 0 else math.inf
        self.max_header_count = limits.max_header_count if limits.max_header_count > 0 else math.inf
        self._max_connections = limits.max_connections if limits.max_connections > 0 else math.inf
        self.head_too_large, self.head_timeout_body, self.body_timeout_body = _limit_answers(limits)
        # The sweep's period: a quarter of the shortest timeout, at most a second. States are timed on `clock`,
        # which only the sweep (and the accept loop) advance, so the start a state records may be up to one period
        # earlier than its real start: each timeout gets one period more, so that no client is cut before its
        # timeout, and each is closed within two periods after it.
        self._sweep_period = _sweep_period(limits)
        # The handshake happens before the connection joins the sweep: the header timeout bounds it instead
        # (None: asyncio's default of 60 s, where the header timeout is off).
        self._handshake_timeout = limits.header_timeout if limits.header_timeout > 0 else None
        self._timeouts = _state_timeouts(limits, self._sweep_period)
        self.clock = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[socket.socket] = []
        self._accepting = False
        self._open = 0  # accepted sockets not yet closed: what the connection cap counts
        self._connecting: dict[asyncio.Task[Any], tuple[socket.socket, HttpConnection]] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _ACCEPT_RETRY_FIRST
        self._sweeper: asyncio.TimerHandle | None = None
        self._warned: dict[str, float] = {}

    @property
    def should_exit(self) -> bool:
        return self.stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self.stopping = True
            self._stop.set()

    def too_large_body(self) -> bytes:
        return (
            b'{"error":"request size exceeds the maximum allowed value of %d bytes; '
            b'use --http-max-input-size to increase the limit"}' % self.max_body_size
        )

    def scope(self, request: Request, client: tuple[str, int] | None) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": client,
            "server": self._server_address,
        }

    async def serve(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.clock = loop.time()
        if self.adopting:  # the supervisor accepts and hands the connections over (`adopt`)
            self._server_address = (self.host, self.port)
        else:
            self._listeners = await bind_listeners(loop, self.host, self.port, 2048, self.reuse_port)
            sockname = self._listeners[0].getsockname()
            self._server_address = (str(sockname[0]), int(sockname[1]))
            self._resume_accepting()
        if self._sweep_period:
            self._sweeper = loop.call_later(self._sweep_period, self._sweep)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            self._pause_accepting()
            for listener in self._listeners:
                listener.close()
            self._listeners = []
            if self._retry is not None:
                self._retry.cancel()
            if self._connecting:  # connections accepted but not yet made: let them join the set closed below
                await asyncio.wait(list(self._connecting), timeout=1.0)
            for connection in list(self.connections):
                connection.close_if_idle()
            while self.inflight:
                await asyncio.sleep(0.01)
            for connection in list(self.connections):
                connection.close_if_idle()
            if self._sweeper is not None:
                self._sweeper.cancel()

    # ---- accepting ------------------------------------------------------------------------------
    #
    # Why not loop.create_server: its accept loop cannot be paused, and neither handles running out of file
    # descriptors well. asyncio logs and retries after a second, but uvloop leaves EMFILE to libuv, which
    # accepts and closes every pending connection (clients see resets: the "normal client reset"),
    # and a listen error it does report closes uvloop's server for good. Accepting here, the server can
    # stop accepting -- remove the listening socket from the loop -- at the connection cap or when descriptors
    # run out, and leave new connections waiting in the kernel's listen backlog, where a client sees a slow
    # connect rather than a refusal (accept-and-hold would spend a descriptor on each waiting client, the very
    # thing that is short). Accepting resumes as soon as a connection closes, or, when descriptors ran out,
    # after a back-off of 50 ms doubling to 1 s (they may be freed elsewhere): never a busy loop. The price is
    # a task per connection (connect_accepted_socket), paid once per connection, not per request.

    def _accept(self, listener: socket.socket) -> None:
        # One connection per readiness event: the listening socket stays readable while more wait (the loop
        # polls level-triggered), so the loop calls again after what else is ready, and a client connecting
        # alone does not pay for the failed accept (an exception) that draining the backlog ends with.
        loop = self._loop
        assert loop is not None
        self.clock = loop.time()
        if self._open >= self._max_connections:
            self._pause_accepting()
            self._warn("cap", "HTTP connections at --http-max-connections (%d): new ones wait in the backlog",
                       self.limits.max_connections)
            return
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another listener's event, a spurious wake-up, or a client that gave up in the backlog
        except OSError as exc:
            # EMFILE / ENFILE (descriptors), ENOBUFS / ENOMEM: the pending connection stays in the backlog.
            # Anything else is unexpected; backing off all the same keeps a persistent error from spinning.
            self._pause_accepting()
            self._retry = loop.call_later(self._retry_delay, self._retry_accepting)
            self._warn("accept", "accepting HTTP connections paused for %.2f s: %s%s", self._retry_delay,
                       exc.strerror or exc, "" if exc.errno in _OUT_OF_RESOURCES else " (unexpected)")
            self._retry_delay = min(self._retry_delay * 2, _ACCEPT_RETRY_MAX)
            return
        self._retry_delay = _ACCEPT_RETRY_FIRST
        self._serve_socket(sock, None)

    def adopt(self, sock: socket.socket, on_close: Callable[[], None]) -> None:
        """Serve a connection another process accepted (the workers' supervisor, geserve/workers/dispatch.py);
        `on_close` is called once it closes."""
        if self.stopping:
            sock.close()
            on_close()
            return
        sock.setblocking(False)
        self._serve_socket(sock, on_close)

    def _serve_socket(self, sock: socket.socket, on_close: Callable[[], None] | None) -> None:
        loop = self._loop
        assert loop is not None
        self._open += 1
        connection = HttpConnection(self, on_close)
        if self.tls is None:
            task = loop.create_task(loop.connect_accepted_socket(lambda: connection, sock))
        else:  # the current context: a reload changes what the next connections get, not the open ones
            task = loop.create_task(loop.connect_accepted_socket(
                lambda: connection, sock, ssl=self.tls.context, ssl_handshake_timeout=self._handshake_timeout
            ))
        self._connecting[task] = (sock, connection)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        sock, connection = self._connecting.pop(task)
        error = "cancelled" if task.cancelled() else task.exception()
        if error is not None and not connection.made:  # e.g. the client reset before the transport was made, or
            # a TLS handshake failed (a plaintext client, an untrusted or missing client certificate, a timeout)
            logger.debug("dropped an accepted HTTP connection: %s", error)
            connection.gone()
            sock.close()  # a no-op when the transport closed it already (both loops leave it detached, fd -1)
            self._open -= 1
            self._resume_accepting()

    def release(self, connection: HttpConnection) -> None:
        """A connection closed: one place under the cap, and one descriptor, are free again."""
        self.connections.discard(connection)
        self._open -= 1
        self._resume_accepting()

    def _pause_accepting(self) -> None:
        if self._accepting and self._loop is not None:
            for listener in self._listeners:
                self._loop.remove_reader(listener.fileno())
            self._accepting = False

    def _resume_accepting(self) -> None:
        if self._accepting or self.stopping or self._loop is None or self._open >= self._max_connections:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for listener in self._listeners:
            self._loop.add_reader(listener.fileno(), self._accept, listener)
        self._accepting = True

    def _retry_accepting(self) -> None:
        self._retry = None
        self._resume_accepting()

    def _warn(self, kind: str, message: str, *args: object) -> None:
        if self.clock - self._warned.get(kind, -math.inf) >= _WARN_EVERY:
            self._warned[kind] = self.clock
            logger.warning(message, *args)

    # ---- timeouts -------------------------------------------------------------------------------

    def _sweep(self) -> None:
        assert self._loop is not None
        now = self.clock = self._loop.time()
        timeouts = self._timeouts
        for connection in list(self.connections):  # a copy: closing may run connection_lost at once
            connection.expire(now, timeouts)
        self._sweeper = self._loop.call_later(self._sweep_period, self._sweep)


def _limit_answers(limits: HttpLimits) -> tuple[bytes, bytes, bytes]:
    """The bodies of the answers to a head over the limits (431), and to a head and a body too slow (408)."""
    allowed = [f"{limit} {unit}" for limit, unit in
               ((limits.max_header_size, "bytes"), (limits.max_header_count, "fields")) if limit > 0]
    message = (f"request header fields too large: at most {' in '.join(allowed)} "
               "(--http-max-header-size, --http-max-header-count)")
    head_timeout = (
        b'{"error":"request timeout: the request headers were not received within %g s '
        b'(--http-header-timeout-secs)"}' % limits.header_timeout
    )
    body_timeout = (
        b'{"error":"request timeout: the request body made no progress for %g s '
        b'(--http-body-timeout-secs)"}' % limits.body_timeout
    )
    return json.dumps({"error": message}, separators=(",", ":")).encode(), head_timeout, body_timeout


def _sweep_period(limits: HttpLimits) -> float:
    enabled = [t for t in (limits.header_timeout, limits.idle_timeout, limits.body_timeout) if t > 0]
    return min(1.0, max(0.01, min(enabled) / 4)) if enabled else 0.0


def _state_timeouts(limits: HttpLimits, sweep_period: float) -> dict[State, float]:
    """How long a connection may stay in each state (HttpConnection.expire), a sweep period more than its limit
    (`inf`: none). A rejecting connection is always owed an answer first (no client time): the header timeout
    closes it should it ever not be."""

    def bound(timeout: float) -> float:
        return timeout + sweep_period if timeout > 0 else math.inf

    header, body = bound(limits.header_timeout), bound(limits.body_timeout)
    return {State.NEW: header, State.HEAD: header, State.BODY: body, State.HELD: body,
            State.IDLE: bound(limits.idle_timeout), State.REJECTING: header}


async def bind_listeners(
    loop: asyncio.AbstractEventLoop, host: str, port: int, backlog: int, reuse_port: bool = False
) -> list[socket.socket]:
    """Listening sockets for host:port, as loop.create_server binds them (every address host resolves to); with
    `reuse_port`, sockets other processes of the server bind too (SO_REUSEPORT: the kernel spreads connections)."""
    infos = await loop.getaddrinfo(
        host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # as asyncio: a family this host lacks (IPv6 turned off) is skipped
                logger.debug("skipping %r: cannot create a socket of its family", address)
                continue
            listeners.append(sock)
            _listen(sock, family, address, backlog, reuse_port)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    if not listeners:
        raise OSError(f"no address to listen on for {host!r}")
    return listeners


def _listen(sock: socket.socket, family: int, address: Any, backlog: int, reuse_port: bool) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:  # as asyncio: an IPv6 socket does not also take the IPv4 port
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: {reason}") from None
    sock.listen(backlog)
    sock.setblocking(False)
