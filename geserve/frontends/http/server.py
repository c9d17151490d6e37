"""Runs the HTTP ASGI app inside the server's own event loop: on geserve's native server, or on uvicorn; over
HTTPS when given TLS files (frontends/tls.py), with the certificate re-read by `reload_tls`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.native_server import HttpLimits, NativeHttpServer, bind_listeners
from geserve.frontends.tls import ServerTls, TlsEndpoint, TlsFiles, asgi_tls_extension

HTTP_SERVERS = ("native", "uvicorn")
logger = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """The geserve process owns signal handling; uvicorn must not install its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return


class _TlsHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, adding the ASGI TLS extension (the client certificate's subject under mutual
    TLS) to every request's scope; uvicorn itself gives none. Made once per connection, after the handshake."""

    mutual = False
    _extensions: dict[str, Any]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._extensions = {"tls": asgi_tls_extension(transport, self.mutual)}

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = self._extensions


def create_http_server(
    app: HttpFrontend, host: str, port: int, log_verbose: int, kind: str, max_body_size: int,
    limits: HttpLimits | None = None, tls: ServerTls | None = None, reuse_port: bool = False, adopting: bool = False,
) -> NativeHttpServer | uvicorn.Server:
    limits = limits or HttpLimits()
    if kind == "native":
        return NativeHttpServer(app, host, port, max_body_size, limits, tls, reuse_port, adopting)
    http: str | type[HttpToolsProtocol] = "httptools"
    if tls is not None:
        http = type("TlsHttpToolsProtocol", (_TlsHttpToolsProtocol,), {"mutual": tls.mutual})
    # uvicorn takes two of the limits: the idle keep-alive timeout, and a cap on connections plus requests (it
    # answers 503 beyond it, where the native server leaves connections in the backlog). Its httptools protocol
    # has no header or body timeouts and no header size or count limits; h11_max_incomplete_event_size is set
    # too, for the day `http="h11"` is chosen: it bounds a head's size there.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http,
        loop="none",
        lifespan="off",
        access_log=log_verbose > 1,
        log_level="debug" if log_verbose > 1 else "warning",
        timeout_keep_alive=math.ceil(limits.idle_timeout) if limits.idle_timeout > 0 else 2**31,
        limit_concurrency=limits.max_connections if limits.max_connections > 0 else None,
        h11_max_incomplete_event_size=limits.max_header_size if limits.max_header_size > 0 else None,
        # No per-response work a client does not ask for: no proxy header rewriting, Server or Date headers.
        proxy_headers=False,
        server_header=False,
        date_header=False,
        backlog=2048,
    )
    if tls is not None:
        # uvicorn hands one SSLContext to loop.create_server for good: the fixed context moves each new
        # connection onto the current one (ServerTls.fixed_context), so reloads reach uvicorn too. Loaded here so
        # that serve() keeps this context (it loads only a config not loaded yet).
        config.load()
        config.ssl = tls.fixed_context()
    return _EmbeddedUvicorn(config)


def _tls_note(tls: ServerTls | None) -> str:
    return "" if tls is None else " (HTTPS, mutual TLS)" if tls.mutual else " (HTTPS)"


class HttpService(TlsEndpoint):
    """The HTTP frontend as the server runs it: the app on its HTTP server, served by a task on the loop."""

    _tls: ServerTls | None

    name = "http"

    def __init__(
        self, app: HttpFrontend, host: str, port: int, *, log_verbose: int = 0, kind: str = "native",
        max_body_size: int, limits: HttpLimits | None = None, tls: TlsFiles | None = None, reuse_port: bool = False,
        adopting: bool = False,
    ) -> None:
        """`adopting` (native only): bind nothing, and serve the connections another process hands to `adopt`."""
        self._host, self._port, self._reuse_port = host, port, reuse_port
        self._tls = ServerTls(tls, "http") if tls is not None else None
        self._server = create_http_server(
            app, host, port, log_verbose, kind, max_body_size, limits, self._tls, reuse_port, adopting
        )
        self._task: asyncio.Task[None] | None = None
        self.reports_arrivals = kind == "native"

    async def start(self) -> None:
        if isinstance(self._server, uvicorn.Server) and self._reuse_port:  # uvicorn has no SO_REUSEPORT option
            listeners = await bind_listeners(asyncio.get_running_loop(), self._host, self._port, 2048, True)
            self._task = asyncio.create_task(self._server.serve(sockets=listeners))
        else:
            self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"failed to start the HTTP service on port {self._port}")
            await asyncio.sleep(0.01)
        if isinstance(self._server, NativeHttpServer) and self._server.adopting:
            logger.info("HTTPService serving the connections the supervisor hands over%s", _tls_note(self._tls))
        else:
            logger.info("started HTTPService at %s:%d%s", self._host, self._port, _tls_note(self._tls))

    def adopt(self, sock: socket.socket, on_close: Callable[[], None]) -> None:
        assert isinstance(self._server, NativeHttpServer)
        self._server.adopt(sock, on_close)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
