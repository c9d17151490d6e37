"""How the native gRPC server answers its calls (h2_connection.GrpcH2Connection's `Responder`): a unary call answered
at once by its Begin, or later through the callback Begin was given, without a task; any other call served by a task
that runs its handler; responses written under the peer's flow control, in one write where the windows allow."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, cast

import grpc
import h2.exceptions
from h2.errors import ErrorCodes

from geserve.frontends.grpc.h2_context import PREFIX, H2Call
from geserve.frontends.grpc.h2_keepalive import Keepalive


class Answered(Protocol):
    """What the responder asks of its connection (h2_connection.GrpcH2Connection): a Protocol, so this module does
    not import the connection that imports it."""

    h2: Any
    keepalive: Keepalive
    loop: asyncio.AbstractEventLoop
    paused: bool

    def forget(self, call: H2Call) -> None: ...

    def flush(self) -> None: ...

    def send(self, data: bytes) -> None: ...

    async def drained(self) -> None: ...


logger = logging.getLogger("geserve.frontends.grpc.h2_connection")  # the connection's log, as before the split

# A unary method's handler that may answer without a task: the response message, an error status (code, details),
# or None to be served by the method's own handler as usual.
Begin = Callable[[Any, Any, Callable[[Any], None]], Any]  # (request, the call as its servicer context, deliver)
Header: TypeAlias = tuple[bytes, bytes]

RESPONSE_HEADERS: list[Header] = [(b":status", b"200"), (b"content-type", b"application/grpc")]
STATUS_SERVER_STOPPING = (grpc.StatusCode.UNAVAILABLE, "server shutting down")


def grpc_message(details: str) -> bytes:
    """The grpc-message header's value: UTF-8, percent-encoding what is outside printable ASCII and '%' (gRPC spec)."""
    raw = details.encode("utf-8")
    if all(0x20 <= byte <= 0x7E and byte != 0x25 for byte in raw):
        return raw
    return b"".join(bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte for byte in raw)


def status_headers(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> list[Header]:
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        headers.append((b"grpc-message", grpc_message(details)))
    if trailers:
        headers.extend((key.encode(), value.encode()) for key, value in trailers)
    return headers


def _behaviour(first: Any, second: Any) -> Callable[[Any, H2Call], Any]:
    """The handler's coroutine (or async generator) function of its shape; grpc's stubs type them synchronous."""
    return cast("Callable[[Any, H2Call], Any]", first if first is not None else second)  # a string: no alias per call


def _too_large(size: int, limit: int) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {limit})"


class Responder:
    """Writes one connection's responses: `begin` (a unary call answered without a task, now or through `answered`),
    `serve` (a call's task), and the writers both use: `respond` (a unary response in one write), `send_now` (one
    message in one frame), `send_message` (a message split to the windows, waiting for them), `finish` (the status).

    Once a call's status is sent (`call.done`) nothing more is written for it; the call is forgotten by the
    connection when its answer is complete."""

    __slots__ = ("_connection", "_h2", "_keepalive", "_loop", "max_send")

    def __init__(self, connection: Answered, max_send: int) -> None:
        self._connection = connection
        self._h2 = connection.h2
        self._keepalive = connection.keepalive
        self._loop = connection.loop
        self.max_send = max_send

    # ---- unary calls answered without a task ----------------------------------------------------------

    def begin(self, call: H2Call, begin: Begin, request: Any) -> bool:
        """A unary call its handler starts without a task (Begin): answered here, now or when it delivers (the
        handler returned the call that withdraws it); False: left to `serve`."""
        answer = begin(request, call, functools.partial(self.answered, call))
        if answer is None:
            return False
        if isinstance(answer, tuple) or not callable(answer):
            self.answered(call, answer)
        else:
            call.withdraw = answer
        return True

    def answered(self, call: H2Call, answer: Any) -> None:
        """A unary call's response message, or its status (a GrpcStatus or a (code, details) pair), sent now."""
        if call.done:  # reset by the client, or the server stopped it
            return
        call.withdraw = None
        if isinstance(answer, tuple):
            self.finish(call, *answer)
        else:
            payload = call.method.response_serializer(answer) if call.method.response_serializer else answer
            if not self.respond(call, payload):  # the windows are short: sent in parts, by a task
                call.task = self._loop.create_task(self._serve_answer(call, payload))
                return
        self._connection.forget(call)

    async def _serve_answer(self, call: H2Call, payload: bytes) -> None:
        """A unary answer `answered` could not send at once: sent as the windows open."""
        try:
            await self.send_message(call, payload)
            self.finish(call, grpc.StatusCode.OK, "")
        except asyncio.CancelledError:
            if not call.reset:
                self.finish(call, *STATUS_SERVER_STOPPING)
            raise
        finally:
            self._connection.forget(call)

    # ---- calls served by a task -----------------------------------------------------------------------

    async def serve(self, call: H2Call, request: Any) -> None:
        method = call.method
        try:
            if method.response_streaming:
                await self._stream(call, _behaviour(method.unary_stream, method.stream_stream)(request, call))
            else:
                response = await _behaviour(method.unary_unary, method.stream_unary)(request, call)
                payload = method.response_serializer(response) if method.response_serializer else response
                if not self.respond(call, payload):
                    await self.send_message(call, payload)
                    self.finish(call, grpc.StatusCode.OK, "")
        except asyncio.CancelledError:
            if not call.reset:  # not the client's doing: the server is stopping
                self.finish(call, *STATUS_SERVER_STOPPING)
            raise
        except grpc.aio.AbortError:
            self.finish(call, call.code, call.details, call.trailers)
        except Exception as exc:
            logger.exception("grpc: unhandled error serving %s", getattr(method, "path", "a call"))
            self.finish(call, grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        finally:
            self._connection.forget(call)

    async def _stream(self, call: H2Call, result: Any) -> None:
        """A response-streaming handler's run: an async generator's responses written as it yields them."""
        if hasattr(result, "__anext__"):
            async for message in result:
                await call.write(message)
        else:
            await result
        self.finish(call, call.code, call.details, call.trailers)

    # ---- writing ------------------------------------------------------------------------------------

    def respond(self, call: H2Call, payload: bytes) -> bool:
        """A unary response in one write (headers, message, trailers) when the peer's window has room for it;
        False when it must be sent in parts."""
        size = len(payload)
        if size > self.max_send:
            self.finish(call, *_too_large(size, self.max_send))
            return True
        if call.done:
            return True
        connection = self._connection
        if connection.paused:
            return False
        frames = self._h2.fast_frames(call.stream_id, True, PREFIX.pack(0, size) + payload, True)
        if frames is None:
            return False
        pending = self._h2.data_to_send()
        connection.send(pending + frames if pending else frames)
        call.done = True
        self._keepalive.last_ping = None  # data sent: the client's next ping is welcome (grpc core)
        return True

    def send_now(self, call: H2Call, payload: bytes) -> bool:
        """One message in one frame, now, when the windows allow it (the common case); False: nothing was sent."""
        connection = self._connection
        if connection.paused or call.done or len(payload) > self.max_send:
            return False
        conn = self._h2
        frames = conn.fast_frames(call.stream_id, not call.headers_sent, PREFIX.pack(0, len(payload)) + payload, False)
        if frames is None:
            return False
        call.headers_sent = True
        self._keepalive.last_ping = None
        pending = conn.data_to_send()
        connection.send(pending + frames if pending else frames)
        return True

    async def send_message(self, call: H2Call, payload: bytes) -> None:
        """One message on the call's stream, split to the peer's frame size and windows, waiting for them to open."""
        size = len(payload)
        if size > self.max_send:
            call.code, call.details = _too_large(size, self.max_send)
            raise grpc.aio.AbortError()
        if call.done or self.send_now(call, payload):
            return
        conn = self._h2
        data = PREFIX.pack(0, size) + payload
        if not call.headers_sent:
            call.headers_sent = True
            conn.send_headers(call.stream_id, RESPONSE_HEADERS)
        if await self._send_parts(call, data):
            self._keepalive.last_ping = None

    async def _send_parts(self, call: H2Call, data: bytes) -> bool:
        """`data` in DATA frames as the windows allow; False: the stream went away before all of it was sent."""
        connection, conn, sid = self._connection, self._h2, call.stream_id
        offset, end = 0, len(data)
        while offset < end:
            if connection.paused:
                await connection.drained()
            if call.closed:  # reset while it waited
                return False
            try:
                window = conn.local_flow_control_window(sid)
            except h2.exceptions.ProtocolError:
                return False
            if window <= 0:
                await self._window_opens(call)
                continue
            chunk = min(window, conn.max_outbound_frame_size, end - offset)
            conn.send_data(sid, data[offset:offset + chunk])
            offset += chunk
            connection.flush()
        return True

    async def _window_opens(self, call: H2Call) -> None:
        self._connection.flush()
        call.window_waiter = self._loop.create_future()
        try:
            await call.window_waiter
        finally:
            call.window_waiter = None

    def finish(
        self, call: H2Call, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Ends the call with its status (and `trailers`, metadata sent with it): trailers, or a trailers-only
        response when nothing was sent yet."""
        if call.done:
            return
        call.done = True
        conn, sid = self._h2, call.stream_id
        status = status_headers(code, details, trailers)
        try:
            conn.send_headers(sid, status if call.headers_sent else RESPONSE_HEADERS + status, end_stream=True)
            if not call.request_ended:  # the client is still sending: tell it to stop (RFC 9113 8.1)
                conn.reset_stream(sid, ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            pass
        self._connection.flush()
