"""The Prometheus endpoint: `GET /metrics` on --metrics-port, a tiny ASGI app on the server's own event loop.

Over HTTPS when the HTTP endpoint is (it follows the --http-use-ssl* settings, mutual TLS included: a scraper then
presents a client certificate), with its certificate re-read by `reload_tls` as HTTP's is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.registry import CollectorRegistry

from geserve.frontends.http.native_server import HttpLimits, NativeHttpServer
from geserve.frontends.tls import ServerTls, TlsEndpoint, TlsFiles
from geserve.metrics import CONTENT_TYPE, render
from geserve.metrics.system import CpuSampler

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
_MAX_BODY = 64 * 1024
# A scrape is one small GET from a few scrapers that keep their connection between scrapes (Prometheus's
# default interval is 15 s to 1 min): short head and body timeouts, an idle timeout past a minute's interval,
# small heads, and room for a few dozen scrapers and dashboards, not for a flood.
_LIMITS = HttpLimits(
    header_timeout=10.0, idle_timeout=90.0, body_timeout=10.0, max_header_size=16 * 1024, max_header_count=64,
    max_connections=128,
)


Exposition = Callable[[], Awaitable[bytes]]
"""The Prometheus text of the whole server, made at scrape time."""


def registry_exposition(registry: CollectorRegistry) -> Exposition:
    """A single process's exposition: its registry, rendered."""

    async def expose() -> bytes:
        return render(registry)

    return expose


class MetricsApp:
    """Answers `GET /metrics` with the server's metrics in Prometheus text format; 404 elsewhere."""

    def __init__(self, exposition: Exposition) -> None:
        self._exposition = exposition

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await _respond(send, 404, b"text/plain", b"Not Found\n")
        elif scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, b"text/plain", b"Method Not Allowed\n")
        else:
            body = await self._exposition()
            await _respond(send, 200, CONTENT_TYPE.encode(), b"" if scope["method"] == "HEAD" else body, len(body))


async def _respond(send: Send, status: int, content_type: bytes, body: bytes, length: int | None = None) -> None:
    size = len(body) if length is None else length
    headers = [(b"content-type", content_type), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    address: str = "0.0.0.0"
    port: int = 8002
    interval_ms: float = 2000.0
    tls: TlsFiles | None = None
    """HTTPS (the HTTP endpoint's TLS files); None: plain HTTP."""


class MetricsService(TlsEndpoint):
    """The endpoint over the server's registry, and the CPU sampler on its interval; a frontend of the server.

    The exposition reads the models at scrape time (geserve.metrics.collector, or every worker's through the
    supervisor: geserve/workers); `cpu` is the sampler it reads."""

    _tls: ServerTls | None

    name = "metrics"
    reports_arrivals = True  # it sends no inference requests

    def __init__(self, exposition: Exposition, options: MetricsOptions, cpu: CpuSampler | None = None) -> None:
        self.options = options
        self._cpu = cpu
        self._exposition = exposition
        self._http: NativeHttpServer | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._tls = ServerTls(options.tls, "metrics") if options.tls is not None else None

    async def start(self) -> None:
        """Bind the endpoint; as in Triton, a port that cannot be bound stops the server from starting."""
        address, port = self.options.address, self.options.port
        if self._cpu is not None:
            self._cpu.sample()  # before the first scrape can arrive
        http = NativeHttpServer(MetricsApp(self._exposition), address, port, _MAX_BODY, _LIMITS, self._tls)
        task = asyncio.create_task(http.serve(), name="metrics-http")
        while not http.started and not task.done():
            await asyncio.sleep(0.01)
        if not http.started:
            raise OSError(f"failed to start the metrics service at {address}:{port}: {task.exception()}")
        self._http, self._http_task = http, task
        if self._cpu is not None:
            self._sampler = asyncio.create_task(self._sample_cpu(), name="metrics-cpu-sampler")
        logger.info("started Metrics Service at %s:%d%s", address, port, " (HTTPS)" if self._tls else "")

    async def _sample_cpu(self) -> None:
        interval = max(self.options.interval_ms, 1.0) / 1000.0
        while True:
            await asyncio.sleep(interval)
            if self._cpu is not None:
                self._cpu.sample()

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
        self._http = self._http_task = self._sampler = None
