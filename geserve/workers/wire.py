"""Calls between the supervisor and its workers: length-prefixed pickle frames over a Unix socket, both ways.

Our own because the need is small and local: two trusted processes of one server, a private socket (mode 0700
folder), calls that may cross (either side may call the other while one of its own calls waits), and errors that
must arrive as the server's own error codes. multiprocessing's Connection is blocking; asyncio streams with a
4-byte length make the whole protocol this module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from geserve.errors import (
    AlreadyExistsError,
    CancelledError,
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
}


class PeerGone(UnavailableError):
    """The other process closed the connection (it exited) before answering."""


def _error_state(exc: BaseException) -> tuple[str, str, str | None]:
    if isinstance(exc, GeserveError):
        return exc.code.value, exc.message, exc.failure_reason
    return ErrorCode.INTERNAL.value, f"{type(exc).__name__}: {exc}", None


def _rebuild_error(state: tuple[str, str, str | None]) -> GeserveError:
    code, message, reason = state
    return _ERRORS.get(ErrorCode(code), InternalError)(message, reason)


class Peer:
    """One end of the connection: `call` waits for the other end's answer, `notify` does not; calls that arrive
    are run by `handler` (each in its own task, so a slow one never blocks the rest)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
        self._reader, self._writer, self._handler = reader, writer, handler
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    def start(self) -> None:
        self._reading = asyncio.create_task(self._read_loop(), name="workers-peer")

    async def call(self, method: str, *args: Any) -> Any:
        if self.closed.is_set():
            raise PeerGone("the worker connection is closed")
        self._next_id += 1
        call_id = self._next_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._send((_CALL, call_id, method, args))
            return await future
        finally:
            self._pending.pop(call_id, None)

    def notify(self, method: str, *args: Any) -> None:
        if not self.closed.is_set():
            self._send((_NOTE, 0, method, args))

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(_HEADER.size)
                kind, call_id, first, second = pickle.loads(await self._reader.readexactly(_HEADER.unpack(header)[0]))
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
                            future.set_exception(_rebuild_error(first))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(PeerGone("the other process exited before answering"))

    async def _run(self, kind: int, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = await self._handler(method, args)
        except Exception as exc:
            if kind == _NOTE:
                logger.warning("worker notice '%s' failed: %s", method, exc)
            elif not self.closed.is_set():
                self._send((_FAIL, call_id, _error_state(exc), None))
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
