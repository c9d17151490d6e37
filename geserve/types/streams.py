"""Responses of a decoupled model: any number per request, sent from any thread, read on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from geserve.errors import GeserveError
from geserve.types.tensors import InferenceResponse


@dataclass(slots=True)
class StreamResponse:
    """One step of a request's stream: a response, an error, or (both None) the final flag sent alone."""

    response: InferenceResponse | None
    error: GeserveError | None = None
    final: bool = False


class StreamClosedError(Exception):
    """A response was sent after the stream's final one."""


class ResponseStream:
    """A one-request channel: producers on any thread `send`; one reader on `loop` iterates until final.

    Order is kept (every send goes through the loop's FIFO of `call_soon_threadsafe` callbacks). Once the
    reader stops early (the client went away), `cancelled` turns true and later sends are dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[StreamResponse] = asyncio.Queue()
        self._lock = threading.Lock()
        self._final_sent = False
        self.cancelled = False

    @property
    def final_sent(self) -> bool:
        return self._final_sent

    def send(self, item: StreamResponse) -> None:
        """Thread-safe; raises StreamClosedError once the final item went."""
        with self._lock:
            if self._final_sent:
                raise StreamClosedError("the final response of this request was already sent")
            self._final_sent = item.final
        if self.cancelled:
            return
        # RuntimeError: the loop is closed, the server is gone, and so is the reader
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def fail(self, error: GeserveError) -> bool:
        """End the stream with `error` unless it already ended; True when this call ended it."""
        try:
            self.send(StreamResponse(None, error, final=True))
        except StreamClosedError:
            return False
        return True

    async def __aiter__(self) -> AsyncIterator[StreamResponse]:
        while True:
            item = await self._queue.get()
            yield item
            if item.final:
                return
