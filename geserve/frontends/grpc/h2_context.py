"""One call of the native gRPC server (an HTTP/2 stream): its state, the request messages it receives, and the
servicer context its handler sees (metadata, peer, deadline, cancellation, abort, streamed writes)."""

from __future__ import annotations

import asyncio
import base64
import collections
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from geserve.frontends.tls import grpc_auth_context

PREFIX = struct.Struct(">BI")  # a message's compressed flag and length
# Transport headers grpc hides from invocation_metadata() (user-agent it keeps); pseudo-headers are hidden too.
_HIDDEN = frozenset({b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                     b"grpc-internal-encoding-request"})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_WBITS = {b"gzip": 31, b"deflate": 15}  # grpc's deflate is zlib's format, gzip gzip's
_INBOX_LIMIT = 16  # streamed requests waiting for the handler before their bytes go unacknowledged (backpressure)


class Sender(Protocol):
    """What a call asks of its connection's writer (h2_responder.Responder)."""

    async def send_message(self, call: H2Call, payload: bytes) -> None: ...

    def send_now(self, call: H2Call, payload: bytes) -> bool: ...


class Connection(Protocol):
    """What a call asks of its connection (h2_connection.GrpcH2Connection)."""

    max_receive: int
    peer: str
    loop: asyncio.AbstractEventLoop

    @property
    def responder(self) -> Sender: ...

    @property
    def transport(self) -> asyncio.BaseTransport | None: ...  # over TLS, its ssl_object holds the client certificate

    def acknowledge(self, call: H2Call) -> None: ...


class CallError(Exception):
    """A fault of the call's transport (an oversized message, an unknown compression): ends it with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def parse_timeout(value: bytes) -> float | None:
    """Seconds of a grpc-timeout header ("<digits><unit>"), None when malformed (grpc ignores those too)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


class H2Call:
    """The servicer context of one call, and the connection's record of it."""

    __slots__ = ("_metadata", "buffer", "code", "connection", "deadline", "details", "done", "encoding", "headers",
                 "headers_sent", "inbox", "inbox_waiter", "method", "now", "on_message", "request", "request_ended",
                 "reset", "stream_id", "task", "trailers", "unacked", "window_waiter", "withdraw")

    def __init__(self, connection: Connection, stream_id: int, method: grpc.RpcMethodHandler[Any, Any],
                 headers: list[tuple[bytes, bytes]], deadline: float | None, encoding: bytes | None) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.method = method
        self.headers = headers
        self.deadline = deadline
        self.encoding = encoding
        self.task: asyncio.Task[None] | None = None
        self.buffer = bytearray()  # bytes of a message not yet complete
        # Streamed requests: complete messages not yet read (one `on_message` declined is kept parsed).
        self.inbox: collections.deque[bytes | _Parsed] | None = None
        self.inbox_waiter: asyncio.Future[None] | None = None
        # A streaming handler's way to take each request as it arrives (`answer_messages_now`), parsed.
        self.on_message: Callable[[Any], bool] | None = None
        self.now: Callable[[Any, H2Call, Callable[[Any], None]], Any] | None = None  # the unary method's Begin
        self.withdraw: Callable[[], None] | None = None  # withdraws the request Begin started (h2_connection.py)
        self.request: bytes | None = None  # a unary call's request message, until its stream ends
        self.unacked = 0  # flow-controlled bytes received but not yet handed back (a slow streaming reader)
        self.request_ended = False
        self.headers_sent = False
        self.done = False  # the status went out (or the stream is gone): nothing more may be sent
        self.reset = False  # the client reset the stream or the connection went away
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailers: tuple[tuple[str, str], ...] = ()  # metadata sent with the status (grpc.aio's abort takes it)
        self.window_waiter: asyncio.Future[None] | None = None
        self._metadata: tuple[tuple[str, str | bytes], ...] | None = None

    # ---- request messages ---------------------------------------------------------------------------

    def take_messages(self, data: bytes) -> list[bytes]:
        """Appends received bytes; returns the complete messages they finish (decompressed). Raises CallError.

        A message larger than a frame gathers in a bytearray, appended in place: joining each frame to the bytes held
        copied them all again (quadratic: a 32 MiB request took 17 s)."""
        if self.buffer:
            self.buffer += data
            if not self._holds_a_message():
                return []
            buffer: bytes | bytearray = self.buffer
        else:
            buffer = data
        messages: list[bytes] = []
        offset, size = 0, len(buffer)
        limit = self.connection.max_receive
        with memoryview(buffer) as view:  # a message is copied out once
            while size - offset >= 5:
                compressed, length = PREFIX.unpack_from(buffer, offset)
                if length > limit:
                    raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"Received message larger than max ({length} vs. {limit})")
                end = offset + 5 + length
                if end > size:
                    break
                message = bytes(view[offset + 5:end])
                messages.append(self._decompress(message, limit) if compressed else message)
                offset = end
        self.buffer = bytearray(buffer[offset:]) if offset < size else bytearray()
        return messages

    def _holds_a_message(self) -> bool:
        """Whether the bytes held complete the message they begin (or show its length is over the limit)."""
        buffer = self.buffer
        if len(buffer) < 5:
            return False
        length = PREFIX.unpack_from(buffer, 0)[1]
        return len(buffer) >= 5 + length or length > self.connection.max_receive

    def _decompress(self, message: bytes, limit: int) -> bytes:
        wbits = _WBITS.get(self.encoding or b"")
        if wbits is None:
            name = (self.encoding or b"identity").decode("latin-1")
            raise CallError(grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm '{name}' is disabled")
        inflater = zlib.decompressobj(wbits)
        try:
            plain = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            raise CallError(grpc.StatusCode.INTERNAL, f"Error decompressing message: {exc}") from None
        if len(plain) > limit:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Received message larger than max ({len(plain)} vs. {limit})")
        return plain

    def deliver(self, messages: list[bytes], ended: bool) -> None:
        """Streamed requests: hand them to the handler's `on_message` while nothing waits ahead of them, queue the
        rest for the handler's iterator and wake it."""
        assert self.inbox is not None
        if self.on_message is not None and messages and not self.inbox:
            messages = self._offer(messages, self.on_message, self.inbox)
        self.inbox.extend(messages)
        self.request_ended = self.request_ended or ended
        waiter = self.inbox_waiter
        # Woken only for something to read: messages the hook took would wake the iterator for nothing, every time.
        if waiter is not None and not waiter.done() and (self.inbox or self.request_ended):
            waiter.set_result(None)

    def _offer(self, messages: list[bytes], hook: Callable[[Any], bool],
               inbox: collections.deque[bytes | _Parsed]) -> list[bytes]:
        """Messages handed to `hook` in order until it declines one (kept in the inbox, parsed) or the call ends;
        returns those it did not see, which wait behind the declined one."""
        parse: Callable[[bytes], Any] = self.method.request_deserializer or _identity
        taken = 0
        for message in messages:
            if self.done:
                break
            parsed = parse(message)
            taken += 1
            if not hook(parsed):  # left to the iterator, parsed once; the ones after it wait behind it
                inbox.append(_Parsed(parsed))
                break
        return messages[taken:]

    async def requests(self) -> AsyncIterator[Any]:
        """The request iterator a request-streaming handler reads."""
        inbox = self.inbox
        assert inbox is not None
        parse: Callable[[bytes], Any] = self.method.request_deserializer or _identity
        while True:
            if inbox:
                message = inbox.popleft()
                if self.unacked and len(inbox) < _INBOX_LIMIT:
                    self.connection.acknowledge(self)
                yield message.value if isinstance(message, _Parsed) else parse(message)
            elif self.request_ended:
                return
            else:
                self.inbox_waiter = self.connection.loop.create_future()
                await self.inbox_waiter
                self.inbox_waiter = None

    @property
    def closed(self) -> bool:
        return self.done

    @property
    def backlogged(self) -> bool:
        return self.inbox is not None and len(self.inbox) >= _INBOX_LIMIT

    # ---- the servicer context -------------------------------------------------------------------------

    def stop(self) -> None:
        """The call ends unanswered (reset by its client, or the server stopping): its handler's task is cancelled,
        or the request its Begin started is withdrawn."""
        if self.task is not None:
            self.task.cancel()
        elif self.withdraw is not None:
            withdraw, self.withdraw = self.withdraw, None
            withdraw()

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def peer(self) -> str:
        return self.connection.peer

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        metadata = self._metadata
        if metadata is None:
            items: list[tuple[str, str | bytes]] = []
            for name, value in self.headers:
                if name[:1] == b":" or name in _HIDDEN:
                    continue
                key = name.decode("latin-1")
                if key.endswith("-bin"):
                    items.append((key, base64.b64decode(value + b"=" * (-len(value) % 4))))
                else:
                    items.append((key, value.decode("latin-1")))
            metadata = self._metadata = tuple(items)
        return metadata

    def cancelled(self) -> bool:
        return self.reset

    def auth_context(self) -> dict[str, list[bytes]]:
        return grpc_auth_context(self.connection.transport)  # {} on cleartext; TLS: the client certificate

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.code, self.details, self.trailers = code, details, tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    async def write(self, message: Any) -> None:
        """One response of a response-streaming call, sent as soon as the peer's window allows."""
        serialize: Callable[[Any], bytes] = self.method.response_serializer or _identity
        await self.connection.responder.send_message(self, serialize(message))

    def answer_messages_now(self, hook: Callable[[Any], bool] | None) -> None:
        """From now on, each request message that arrives while none waits to be read goes to `hook` first, parsed,
        on the connection's callback: True when the hook answered it, False to leave it (and those after it) to
        the handler's iterator, in order. For a handler that can answer some requests without awaiting; None when it
        is done answering."""
        self.on_message = hook

    def write_now(self, message: Any) -> bool:
        """`write` without waiting, where the peer's windows let the message go out at once; False: nothing sent.
        Only for a writer with nothing else under way on the call (its messages keep their order)."""
        serialize: Callable[[Any], bytes] = self.method.response_serializer or _identity
        return self.connection.responder.send_now(self, serialize(message))


class _Parsed:
    """A request message already parsed (for `on_message`, which left it to the iterator)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _identity(message: Any) -> Any:
    return message
