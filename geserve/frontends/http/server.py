"""Runs the HTTP ASGI app inside the server's own event loop: on geserve's native server, or on uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterator

import uvicorn

from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.native_server import HttpLimits, NativeHttpServer

HTTP_SERVERS = ("native", "uvicorn")
logger = logging.getLogger(__name__)


class _EmbeddedUvicorn(uvicorn.Server):
    """The geserve process owns signal handling; uvicorn must not install its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return


def create_http_server(
    app: HttpFrontend, host: str, port: int, log_verbose: int, kind: str, max_body_size: int,
    limits: HttpLimits | None = None,
) -> NativeHttpServer | uvicorn.Server:
    limits = limits or HttpLimits()
    if kind == "native":
        return NativeHttpServer(app, host, port, max_body_size, limits)
    # uvicorn takes two of the limits: the idle keep-alive timeout, and a cap on connections plus requests (it
    # answers 503 beyond it, where the native server leaves connections in the backlog). Its httptools protocol
    # has no header or body timeouts and no header size or count limits; h11_max_incomplete_event_size is set
    # too, for the day `http="h11"` is chosen: it bounds a head's size there.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
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
    return _EmbeddedUvicorn(config)


class HttpService:
    """The HTTP frontend as the server runs it: the app on its HTTP server, served by a task on the loop."""

    name = "http"

    def __init__(
        self, app: HttpFrontend, host: str, port: int, *, log_verbose: int = 0, kind: str = "native",
        max_body_size: int, limits: HttpLimits | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._server = create_http_server(app, host, port, log_verbose, kind, max_body_size, limits)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"failed to start the HTTP service on port {self._port}")
            await asyncio.sleep(0.01)
        logger.info("started HTTPService at %s:%d", self._host, self._port)

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
