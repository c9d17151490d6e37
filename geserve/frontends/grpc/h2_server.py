"""The native gRPC server (the default, --grpc-server native): gRPC over cleartext HTTP/2 on the running loop, with
python-hyper's `h2` for framing, HPACK, flow control and settings, serving the grpc.aio server's own handlers.

Why it exists: measured on the 2-core VM (perf_analyzer, MLP, c=16, 2 workers), grpc.aio cost ~730 µs of server
CPU per inference against ~310 µs for the native HTTP/1.1 server; the grpc C core and its asyncio integration are
~400 µs of that per unary call, where h2's server side of a unary call (HEADERS + DATA in, headers + data + trailers
out) is ~100 µs. The handlers are the same objects grpc.aio serves (`inference_handler`, `HealthService.handler`),
resolved once per method path, so both servers answer alike; a small servicer context (h2_context.H2Call) stands in
for grpc.aio's.

TLS (--grpc-use-ssl[-mutual]) is served here too, on the same helpers as the native HTTP server (frontends/tls.py):
an ssl.SSLContext with ALPN h2 (TLS 1.2 or later, HTTP/2's cipher rules), client certificates required and verified
against --grpc-root-cert under mutual TLS, and SIGHUP (`reload_tls`) giving new connections the re-read certificate
while open ones keep theirs (ServerTls.fixed_context: loop.create_server takes one context for good). A call's auth
context carries the verified client certificate as grpc.aio's does (tls.grpc_auth_context), so the caller's identity
is the same on both servers. grpc.aio (server.GrpcServer) serves only when asked (--grpc-server grpcio) or where a
host brings its own grpc server (integrations).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import grpc

from geserve.frontends.grpc import server as aio_server
from geserve.frontends.grpc.h2_connection import GrpcH2Connection, Method
from geserve.frontends.grpc.h2_responder import Begin
from geserve.frontends.grpc.health import HealthService
from geserve.frontends.grpc.server import (
    GrpcInferenceServicer,
    GrpcOptions,
    call_context,
    grpc_target,
    inference_handler,
)
from geserve.frontends.http.native_server import bind_listeners
from geserve.frontends.tls import H2_ALPN, ServerTls, TlsEndpoint
from geserve.service.service import InferenceService

logger = logging.getLogger(__name__)

BACKLOG = 1024
# How long a client has to finish its TLS handshake: gRPC core's server default (GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS).
HANDSHAKE_TIMEOUT_S = 120.0


class _CallDetails(grpc.HandlerCallDetails):
    """What a GenericRpcHandler is asked with: the method's path (metadata is not used to route)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


class MethodTable:
    """Method path -> its handler, asked of the generic handlers once per path and kept (unknown paths are not
    kept: a client could make up any number of them)."""

    def __init__(self, handlers: tuple[grpc.GenericRpcHandler, ...], now: dict[str, Begin] | None = None) -> None:
        """`now`: for some unary methods, a handler that starts a call without a task (h2_responder.Begin)."""
        self._handlers = handlers
        self._known: dict[bytes, Method] = {}
        self._now = {path.encode("ascii"): handler for path, handler in (now or {}).items()}

    def begin(self, path: bytes | None) -> Begin | None:
        return self._now.get(path) if path is not None else None

    def resolve(self, path: bytes | None) -> Method | None:
        method = self._known.get(path) if path is not None else None
        if method is not None or path is None:
            return method
        try:
            name = path.decode("ascii")
        except UnicodeDecodeError:
            return None
        for handler in self._handlers:
            method = handler.service(_CallDetails(name))
            if method is not None:
                self._known[path] = method
                return method
        return None


class NativeGrpcServer(TlsEndpoint):
    """inference.GRPCInferenceService and grpc.health.v1.Health over h2, on the running loop, over cleartext or TLS
    (`options.tls`; `serves_tls`, and `reload_tls` on SIGHUP)."""

    _tls: ServerTls | None

    name = "grpc"
    reports_arrivals = True  # each open connection counts as a source that may send at any time (arrivals.py)

    def __init__(self, service: InferenceService, options: GrpcOptions, adopting: bool = False) -> None:
        """`adopting`: bind nothing and serve only the connections handed to `adopt` (a worker of --workers whose
        supervisor accepts them). The TLS files are read here: a fault stops the start with the flag named."""
        self._tls = ServerTls(options.tls, "grpc", H2_ALPN) if options.tls is not None else None
        self._service = service
        self.options = options
        self.port = options.port
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[GrpcH2Connection] = set()
        self._adopting = adopting
        self._factory: Callable[[], GrpcH2Connection] | None = None
        self._stopping = False

    @property
    def target(self) -> str:
        return grpc_target(self.options.address, self.port)

    async def start(self) -> None:
        servicer = GrpcInferenceServicer(self._service)
        health = HealthService(lambda context: self._service.ready(call_context(context)))
        methods = MethodTable((inference_handler(servicer), health.handler()),
                              {"/inference.GRPCInferenceService/ModelInfer": servicer.begin})
        options, connections = self.options, self._connections
        loop = asyncio.get_running_loop()

        def connection() -> GrpcH2Connection:
            return GrpcH2Connection(options, methods.resolve, connections, methods.begin)

        self._factory = connection
        if self._tls is not None and self._tls.mutual:
            # call_context reads a call's auth context (the client certificate) only once a server verifies them.
            aio_server.verify_clients()
        if self._adopting:
            logger.info("started GRPCInferenceService (native HTTP/2%s) on the connections handed to this worker",
                        self._tls_note())
            return
        try:
            listeners = await bind_listeners(loop, options.address, options.port, BACKLOG, options.reuse_port)
        except OSError as exc:
            raise OSError(f"failed to start the GRPC service: unable to bind {self.target} ({exc})") from None
        if self.port == 0:
            self.port = listeners[0].getsockname()[1]

        # loop.create_server rather than accepting ourselves (as the HTTP server does): gRPC connections are few and
        # long-lived, there is no connection cap to pause accepting at, and uvloop's accept loop runs in C.
        # TLS: the first context for good, which moves each handshake onto the current one (reloads reach it).
        tls: dict[str, Any] = {}
        if self._tls is not None:
            tls = {"ssl": self._tls.fixed_context(), "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        for sock in listeners:
            self._servers.append(await loop.create_server(connection, sock=sock, backlog=BACKLOG, **tls))
        logger.info("started GRPCInferenceService at %s (native HTTP/2%s)", self.target, self._tls_note())

    @property
    def tls(self) -> str:
        """What the server speaks: "cleartext", "TLS" or "mutual TLS"."""
        return "cleartext" if self._tls is None else "mutual TLS" if self._tls.mutual else "TLS"

    def _tls_note(self) -> str:
        return "" if self._tls is None else f", {self.tls}"

    def adopt(self, sock: socket.socket, on_close: Callable[[], None]) -> None:
        """Serves a connection another process accepted; `on_close` is called once it closes."""
        factory = self._factory
        if factory is None or self._stopping:
            sock.close()
            on_close()
            return
        sock.setblocking(False)

        def connection() -> GrpcH2Connection:
            made = factory()
            made.on_close = on_close
            return made

        loop = asyncio.get_running_loop()
        if self._tls is None:
            task = loop.create_task(loop.connect_accepted_socket(connection, sock))
        else:  # the current context: a reload changes what the next connections get
            task = loop.create_task(loop.connect_accepted_socket(
                connection, sock, ssl=self._tls.context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S))

        def connected(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or task.exception() is not None:  # never served: counted closed all the same
                sock.close()
                on_close()

        task.add_done_callback(connected)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stops accepting, sends every connection a GOAWAY, lets calls under way finish for up to `grace` seconds,
        then cancels what still runs and closes the connections."""
        self._stopping = True
        for server in self._servers:
            server.close()
        self._servers.clear()
        for connection in list(self._connections):
            connection.go_away()
        if grace:
            await self._calls_end(grace)
        for connection in list(self._connections):
            connection.abort_calls()
        await self._calls_end(1.0)
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()

    async def _calls_end(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the tasks of the calls under way to end."""
        tasks = [task for connection in self._connections for task in connection.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
