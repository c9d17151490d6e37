"""Runs the HTTP ASGI app on uvicorn (httptools parser) inside the server's own event loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

from geserve.frontends.http.app import HttpFrontend


class _EmbeddedUvicorn(uvicorn.Server):
    """The geserve process owns signal handling; uvicorn must not install its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return


def create_http_server(app: HttpFrontend, host: str, port: int, log_verbose: int) -> uvicorn.Server:
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
        backlog=2048,
    )
    return _EmbeddedUvicorn(config)
