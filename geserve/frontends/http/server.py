"""Runs the HTTP ASGI app inside the server's own event loop: on geserve's native server, or on uvicorn."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.native_server import NativeHttpServer

HTTP_SERVERS = ("native", "uvicorn")


class _EmbeddedUvicorn(uvicorn.Server):
    """The geserve process owns signal handling; uvicorn must not install its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return


def create_http_server(
    app: HttpFrontend, host: str, port: int, log_verbose: int, kind: str, max_body_size: int
) -> NativeHttpServer | uvicorn.Server:
    if kind == "native":
        return NativeHttpServer(app, host, port, max_body_size)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
        loop="none",
        lifespan="off",
        access_log=log_verbose > 1,
        log_level="debug" if log_verbose > 1 else "warning",
        timeout_keep_alive=75,
        # No per-response work a client does not ask for: no proxy header rewriting, Server or Date headers.
        proxy_headers=False,
        server_header=False,
        date_header=False,
        backlog=2048,
    )
    return _EmbeddedUvicorn(config)
