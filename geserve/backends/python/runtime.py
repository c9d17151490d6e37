"""How Python-model code reaches the server it runs in: BLS calls from worker and user threads to the host's loop.

Model code runs on instance worker threads (or threads it starts itself), never on the server's event loop, so a
BLS call schedules the host's coroutine on that loop with `run_coroutine_threadsafe` and waits on (or awaits) the
concurrent future it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

from geserve.backends.base import InferenceHost
from geserve.errors import GeserveError, InternalError, UnavailableError
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.streams import StreamResponse

_default_host: InferenceHost | None = None  # the server's inference service (one server per process, usually)
_local = threading.local()  # `host` of the instance running on this thread, when several servers share a process


def set_default_host(host: InferenceHost) -> None:
    global _default_host
    _default_host = host


def bind_thread(host: InferenceHost) -> None:
    """Instance threads know their own server, whatever the process-wide default is."""
    _local.host = host


def _host_and_loop() -> tuple[InferenceHost, asyncio.AbstractEventLoop]:
    host = getattr(_local, "host", None) or _default_host
    loop = getattr(host, "loop", None) if host is not None else None
    if host is None or loop is None or loop.is_closed():
        raise UnavailableError("no running inference server to send the BLS request to")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # waiting here would stall the very loop that must serve the call
        raise InternalError("a BLS request cannot be made from the server's own event loop")
    return host, loop


def infer(request: InferenceRequest) -> concurrent.futures.Future[InferenceResponse]:
    """Run `request` through the host (the server's inference service); the future raises GeserveError on failure."""
    host, loop = _host_and_loop()
    return asyncio.run_coroutine_threadsafe(host.infer(request), loop)


def stream(request: InferenceRequest, emit: Callable[[StreamResponse], object]) -> concurrent.futures.Future[None]:
    """Each response of `request` (decoupled or not) goes to `emit`, on the host's loop; the last is final."""
    host, loop = _host_and_loop()

    async def pump() -> None:
        try:
            async for item in host.infer_stream(request):
                emit(item)
        except GeserveError as exc:
            emit(StreamResponse(None, exc, final=True))
        except Exception as exc:  # never leave the caller waiting for a final item
            emit(StreamResponse(None, InternalError(f"BLS stream failed: {exc}"), final=True))

    return asyncio.run_coroutine_threadsafe(pump(), loop)
