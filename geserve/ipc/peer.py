"""Calls between two processes of one server: length-prefixed frames over a Unix socket, both ways.

Our own because the need is small and local: two trusted processes of one server, a private socket (mode 0700
folder, or a socket pair), calls that may cross (either side may call the other while one of its own calls waits),
and errors that must arrive as the server's own error codes. multiprocessing's Connection is blocking; asyncio streams
with a 4-byte length make the whole protocol this module. Frames are pickled by default; a `Codec` may place what
they carry elsewhere (a Python model's process sends large arrays through shared memory: backends/python/isolation).
A thread that is not the loop's calls with `call_threadsafe`: its message is encoded on that thread, not the loop's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from geserve.errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    ErrorCode,
    GeserveError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnsupportedError,
)

logger = logging.getLogger(__name__)

Handler = Callable[[str, tuple[Any, ...]], Awaitable[Any]]
ErrorState = tuple[str, str, str | None]
_Waiting = asyncio.Future[Any] | concurrent.futures.Future[Any]

_HEADER = struct.Struct("!I")
_CALL, _REPLY, _FAIL, _NOTE = 0, 1, 2, 3
_ERRORS: dict[ErrorCode, type[GeserveError]] = {
    ErrorCode.INVALID_ARG: InvalidArgumentError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.UNSUPPORTED: UnsupportedError,
    ErrorCode.ALREADY_EXISTS: AlreadyExistsError,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.CANCELLED: CancelledError,
    ErrorCode.UNAUTHENTICATED: UnauthenticatedError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}


class PeerGone(UnavailableError):
    """The other process closed the connection (it exited) before answering."""


def error_state(exc: BaseException) -> ErrorState:
    """What crosses for an error: its code, message and failure reason (any other exception is INTERNAL)."""
    if isinstance(exc, GeserveError):
        return exc.code.value, exc.message, exc.failure_reason
    return ErrorCode.INTERNAL.value, f"{type(exc).__name__}: {exc}", None


def rebuild_error(state: ErrorState) -> GeserveError:
    code, message, reason = state
    return _ERRORS.get(ErrorCode(code), InternalError)(message, reason)


class Codec(Protocol):
    """How a frame's message (a tuple) becomes bytes and back."""

    def dumps(self, message: tuple[Any, ...]) -> bytes: ...

    def loads(self, data: bytes) -> tuple[Any, ...]: ...


class PickleCodec:
    def dumps(self, message: tuple[Any, ...]) -> bytes:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)

    def loads(self, data: bytes) -> tuple[Any, ...]:
        result: tuple[Any, ...] = pickle.loads(data)
        return result


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Peer:
    """One end of the connection: `call` waits for the other end's answer, `notify` does not; calls that arrive
    are run by `handler` (each in its own task, so a slow one never blocks the rest)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler,
        codec: Codec | None = None, name: str = "workers-peer",
    ) -> None:
        self._reader, self._writer, self._handler = reader, writer, handler
        self._codec: Codec = codec if codec is not None else PickleCodec()
        self._name = name
        self._pending: dict[int, _Waiting] = {}
        self._ids = itertools.count(1)  # next() is atomic: threads take ids too (call_threadsafe)
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    def start(self) -> None:
        self._reading = asyncio.create_task(self._read_loop(), name=self._name)

    async def call(self, method: str, *args: Any) -> Any:
        if self.closed.is_set():
            raise PeerGone("the worker connection is closed")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._send((_CALL, call_id, method, args))
            return await future
        finally:
            self._pending.pop(call_id, None)

    def call_threadsafe(
        self, loop: asyncio.AbstractEventLoop, method: str, *args: Any
    ) -> concurrent.futures.Future[Any]:
        """`call` from another thread than `loop`'s: the message is encoded here; the future has the answer."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._ids)
        frame = self._codec.dumps((_CALL, call_id, method, args))
        try:
            loop.call_soon_threadsafe(self._start_call, call_id, frame, future)
        except RuntimeError:  # the loop is closed: nothing will ever answer
            future.set_exception(PeerGone("the connection's event loop is closed"))
        return future

    def _start_call(self, call_id: int, frame: bytes, future: concurrent.futures.Future[Any]) -> None:
        if self.closed.is_set():
            future.set_exception(PeerGone("the connection is closed"))
            return
        self._pending[call_id] = future
        future.add_done_callback(lambda _: self._pending.pop(call_id, None))
        self._write(frame)

    def notify(self, method: str, *args: Any) -> None:
        if not self.closed.is_set():
            self._send((_NOTE, 0, method, args))

    def notify_threadsafe(self, loop: asyncio.AbstractEventLoop, method: str, *args: Any) -> None:
        """`notify` from any thread (the loop's included), encoded on that thread; dropped once the loop is closed."""
        frame = self._codec.dumps((_NOTE, 0, method, args))
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._write, frame)

    def notify_written(self, loop: asyncio.AbstractEventLoop, method: str, *args: Any, timeout: float = 10.0) -> None:
        """`notify_threadsafe`, returning once the notice is in the socket (on a Unix socket: queued at the other
        end), so that it arrives even if this process dies right after."""
        frame = self._codec.dumps((_NOTE, 0, method, args))
        if _running_loop() is loop:  # on the loop itself: the write is immediate, or the transport buffers it
            self._write(frame)
            return
        try:
            written = asyncio.run_coroutine_threadsafe(self._flush(frame), loop)
        except RuntimeError:  # the loop is closed
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, ConnectionError):
            written.result(timeout)

    async def _flush(self, frame: bytes) -> None:
        self._write(frame)
        if not self.closed.is_set():
            await self._writer.drain()

    def _send(self, message: tuple[Any, ...]) -> None:
        self._write(self._codec.dumps(message))

    def _write(self, data: bytes) -> None:
        if not self.closed.is_set():
            self._writer.write(_HEADER.pack(len(data)) + data)

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(_HEADER.size)
                data = await self._reader.readexactly(_HEADER.unpack(header)[0])
                kind, call_id, first, second = self._codec.loads(data)
                if kind in (_CALL, _NOTE):
                    task = asyncio.create_task(self._run(kind, call_id, first, second))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    future = self._pending.get(call_id)
                    if future is not None and not future.done():
                        if kind == _REPLY:
                            future.set_result(first)
                        else:
                            future.set_exception(rebuild_error(first))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            # Closed now, not left to the collector: uvloop closes a collected transport's descriptor, then the
            # socket object it was opened on closes the same number again, by then perhaps another connection's.
            self._writer.close()
            for future in list(self._pending.values()):
                if not future.done():
                    future.set_exception(PeerGone("the other process exited before answering"))

    async def _run(self, kind: int, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = await self._handler(method, args)
        except Exception as exc:
            if kind == _NOTE:
                logger.warning("notice '%s' from the other process failed: %s", method, exc)
            elif not self.closed.is_set():
                self._send((_FAIL, call_id, error_state(exc), None))
            return
        if kind == _CALL and not self.closed.is_set():
            self._send((_REPLY, call_id, result, None))

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
        if self._reading is not None:
            await self._reading
        for task in list(self._tasks):
            task.cancel()
