"""A lean HTTP/1.1 server for ASGI apps, on httptools and the server's own event loop.

Written here because uvicorn spent ~100 µs of CPU per request on its ASGI plumbing where this spends ~30
(measured on a trivial app): for small models that is most of the served latency. It does what the
inference protocol needs: keep-alive, pipelining (answered in order), Content-Length and chunked request
bodies, `Expect: 100-continue`, a body-size limit enforced while reading, and a graceful stop. A client that
repeats one kind of request gets its head replayed rather than parsed again (`_Replay`).

Connection limits (`HttpLimits`, the --http-* flags) keep slow, idle and hostile clients from holding the
server: a header-read timeout, an idle keep-alive timeout and a body-progress timeout (408), a cap on header
size and count (431), and a cap on open connections. The timeouts cost a request nothing but a few attribute
stores: each connection records its phase and when it entered it on a coarse clock, and one periodic sweep
(at most every second) closes the connections whose phase has lasted too long. The server accepts its own
connections, so that at the connection cap, or when file descriptors run out, it can stop accepting and
leave new connections waiting in the listen backlog rather than refusing them (see `_accept`).

HTTPS (`tls`, a frontends.tls.ServerTls): each accepted socket is wrapped with the endpoint's current SSLContext,
so a certificate reloaded on SIGHUP serves the next connections while the open ones keep theirs. The TLS
handshake counts against the header timeout (it bounds the handshake); the client certificate's subject (mutual
TLS) is read once per connection and reaches the app in the ASGI TLS extension (scope["extensions"]["tls"]). A
plaintext server pays nothing for this but one attribute test per request.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import json
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast, runtime_checkable
from urllib.parse import unquote

import httptools

from geserve.arrivals import ARRIVALS
from geserve.frontends.tls import ServerTls, asgi_tls_extension

logger = logging.getLogger(__name__)

_REASONS = {
    100: b"Continue", 200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
    408: b"Request Timeout", 409: b"Conflict", 413: b"Payload Too Large", 431: b"Request Header Fields Too Large",
    500: b"Internal Server Error", 501: b"Not Implemented", 503: b"Service Unavailable",
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 64  # requests parsed ahead of the one being answered before reading pauses
_JOIN_BELOW = 64 * 1024  # response bodies up to this size are joined to their head (one buffer, one write)

# A connection's phase, which picks the timeout that applies to it (`_Connection.expire`).
_NEW, _HEAD, _BODY, _IDLE = 0, 1, 2, 3  # connected, nothing yet / in a request's head / in its body / between
# Most bytes one data_received call can carry (asyncio's and uvloop's read size): a head still incomplete after
# a read may have counted up to this many bytes of the previous request, so the raw guard allows for them.
_READ_SLACK = 256 * 1024
_REPLAY_MAX = 64 * 1024  # largest request (head and body) a connection replays (`_Replay`): parsing a larger one
# costs little beside its bytes, and its reads are not joined
_ACCEPT_RETRY_FIRST, _ACCEPT_RETRY_MAX = 0.05, 1.0  # seconds before accepting again when descriptors ran out
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_WARN_EVERY = 10.0  # seconds between two warnings of the same kind (a flood must not flood the log)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP client may hold of the server (the --http-* flags; 0 turns a limit off)."""

    header_timeout: float = 15.0
    """Seconds a request's line and headers may take from its first byte (a new connection's: from connecting)."""
    idle_timeout: float = 60.0
    """Seconds a keep-alive connection may wait, with no request under way, for its next request."""
    body_timeout: float = 30.0
    """Seconds a request body may go without a byte arriving."""
    max_header_size: int = 64 * 1024
    """Largest request line plus headers, in bytes."""
    max_header_count: int = 100
    """Most header fields in one request."""
    max_connections: int = 1024
    """Most connections open at once; further ones wait in the listen backlog."""


@runtime_checkable
class DirectApp(Protocol):
    """An ASGI app that also answers a request in one call, without ASGI's scope and messages (the inference
    frontend: geserve/frontends/http/app.py); the server then calls `respond` instead, ~10 µs less per request."""

    shortcuts: bool
    """Whether the request path's shortcuts are on (--inference-shortcuts): the connection's replay is one."""

    async def respond(
        self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
        client: tuple[str, int] | None, extensions: dict[str, Any] | None,
    ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any]:
        """(status, body, content type, more headers, a trace to mark "HTTP_SEND_START" and finish or None)."""
        ...

    def begin(
        self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
        client: tuple[str, int] | None, extensions: dict[str, Any] | None,
        deliver: Callable[[tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any]], None],
    ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any] | Callable[[], None] | None:
        """`respond` without a task, where the app can start the request now: its answer when it has one at once,
        else the call that withdraws it (the client went away: `deliver` is then never called), `deliver` being
        called (once, from a later turn of the loop) with its answer. None (having done nothing) elsewhere."""
        ...


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over the limits (answered 431)."""


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    http_version: str
    body: list[bytes] = field(default_factory=list)
    too_large: bool = False
    rejection: tuple[int, bytes] | None = None
    """Set on a stand-in for a request that could not be parsed: the answer owed, in its turn, before closing."""


@dataclass(frozen=True, slots=True)
class _Replay:
    """A request head this connection sent, and the request the app answered directly (`_answer_direct`) from it.
    Parsing is a function of the bytes, so later reads that are the same head and a body of the same length (a client
    repeating one kind of request: perf_analyzer, tritonclient) are that request again with the new body: answered
    without httptools, its callbacks and a new `_Request` (about a third of an express lane request's Python). The
    body may come in later reads (libcurl sends the head and the body apart); anything else is parsed."""

    head: bytes
    size: int  # the head and its body (the head's Content-Length)
    request: _Request  # its body list is left empty: the body travels beside it
    headers: dict[bytes, bytes]


class _Connection(asyncio.Protocol):
    def __init__(self, server: NativeHttpServer, on_close: Callable[[], None] | None = None) -> None:
        self._server = server
        self._on_close = on_close  # an adopted connection's: its supervisor counts it
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending: collections.deque[_Request] = collections.deque()
        self._current: _Request | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body_size = 0
        self._worker: asyncio.Task[None] | None = None
        self._owed: Callable[[], None] | None = None  # withdraws the request the app answers later (DirectApp.begin)
        self._replay: _Replay | None = None
        self._held = b""  # a replayed head and the part of its body read so far
        self._messages = 0  # requests begun
        self._raw: bytes | None = None  # the reads since a request began at the start of one (to learn a replay)
        self._raw_begun = 0  # `_messages` before it
        self._answered_directly: tuple[_Request, dict[bytes, bytes], bytes] | None = None  # in this read
        self._loop = asyncio.get_running_loop()  # kept: each lookup costs a getpid() system call
        self._paused = False
        self._closing = False
        self._stopped_reading = False  # a rejection is owed: nothing more is parsed
        self.made = False
        # The phase and when it began, on the server's coarse clock (see NativeHttpServer.clock).
        self._phase = _NEW
        self._since = server.clock
        self._head_size = 0  # bytes of the header names and values (for the 431 check)
        self._head_raw = 0  # bytes read while a head stays incomplete (bounds a header that never ends)
        self._client: tuple[str, int] | None = None
        self._extensions: dict[str, Any] | None = None  # HTTPS: the scope's "extensions", made once per connection
        # Counted in ARRIVALS.idle_clients while it may send a request (from its accept until it closes, except
        # while a request of its is under way): a batcher waits for no request while every client waits on one.
        self._idle = True
        ARRIVALS.connected()

    # ---- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self.made = True
        peer = transport.get_extra_info("peername")  # once: uvloop asks the socket (a syscall) every time
        self._client = (peer[0], peer[1]) if peer else None
        tls = self._server.tls
        if tls is not None:  # called once the handshake is done: the peer's certificate is known
            self._extensions = {"tls": asgi_tls_extension(transport, tls.mutual)}
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.release(self)
        self._closing = True
        self.gone()
        if self._worker is not None and not self._worker.done():
            # The client went away with a request under way: cancelling the connection's one task cancels the
            # service call it awaits (a queued request leaves its scheduler, counted CANCELED), and nothing is written.
            # No per-request watcher: the ASGI receive channel would need a second task per request to notice this.
            self._worker.cancel()
        if self._owed is not None:  # the same for a request the app answers later: withdrawn
            withdraw, self._owed = self._owed, None
            self._server.inflight -= 1
            withdraw()

    def data_received(self, data: bytes) -> None:
        if self._closing or self._stopped_reading:
            return
        replay = self._replay
        if replay is not None and (self._held or self._phase == _IDLE) and not self._owing():
            if self._held:
                data, self._held = self._held + data, b""
                self._phase = _IDLE  # the parser saw none of it: what is not replayed is parsed from its start
            if len(data) <= replay.size and data.startswith(replay.head):
                self._since = self._server.clock
                if len(data) < replay.size:  # the body is on its way
                    self._held = data
                    self._phase = _BODY
                    return
                if self._answer_direct(replay.request, replay.headers, data[len(replay.head):]):
                    return
                self._replay = None  # the app routes it now (a model reloaded, unloaded, ...): parsed as any other
        if self._phase == _IDLE or self._phase == _NEW:
            self._raw, self._raw_begun = (data if len(data) <= _REPLAY_MAX else None), self._messages
        elif self._raw is not None:
            self._raw = self._raw + data if len(self._raw) + len(data) <= _REPLAY_MAX else None
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b'{"error":"protocol upgrades are not supported"}')
            return
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadTooLarge):
                self._reject(431, self._server.head_too_large)
            else:
                self._reject(400, b'{"error":"malformed HTTP request: %s"}' % str(exc).encode(errors="replace"))
            return
        if self._phase == _HEAD:
            # httptools buffers a header field until it ends; a field that never ends is stopped here.
            self._head_raw += len(data)
            if self._head_raw > self._server.max_header_size + _READ_SLACK:
                self._reject(431, self._server.head_too_large)
        answered, self._answered_directly = self._answered_directly, None
        raw, one = self._raw, self._messages == self._raw_begun + 1
        if raw is not None and (self._phase == _IDLE or not one):  # reads that ended a message, or held two
            self._raw = None
            if answered is not None and one and self._phase == _IDLE and self._server.replay:
                self._learn_replay(raw, *answered)

    def _learn_replay(self, raw: bytes, request: _Request, headers: dict[bytes, bytes], body: bytes) -> None:
        """Keep the head of `raw`, the bytes of one whole request the app answered directly, for `_Replay`: only a
        head whose body is the raw bytes read (Content-Length, no transfer coding) and that asks nothing of the server
        while its body is read (no `Expect`)."""
        if b"content-length" not in headers or b"transfer-encoding" in headers or b"expect" in headers:
            return
        head = raw[: len(raw) - len(body)]
        if head.endswith(b"\r\n\r\n"):
            self._replay = _Replay(head, len(raw), request, headers)

    # ---- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._messages += 1
        self._url = b""
        self._headers = []
        self._body_size = 0
        self._head_size = self._head_raw = 0
        if self._phase != _NEW:  # a new connection's head is timed from connecting, not from its first byte
            self._since = self._server.clock
        self._phase = _HEAD

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._head_size += len(name) + len(value)

    def on_headers_complete(self) -> None:
        # The head's limits, checked once it is whole (the raw guard in data_received bounds it until then).
        server = self._server
        count = len(self._headers)
        if count > server.max_header_count or len(self._url) + self._head_size + 4 * count > server.max_header_size:
            raise _HeadTooLarge
        self._phase = _BODY
        self._since = server.clock
        url = self._url
        if b"?" in url or b"%" in url or b"#" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            path, query = unquote(parsed.path.decode(errors="replace")), parsed.query or b""
        else:  # the usual request path: nothing to split off or decode
            path, query = url.decode(errors="replace"), b""
        request = _Request(
            method=self._parser.get_method().decode(),
            path=path,
            query=query,
            headers=self._headers,
            keep_alive=self._parser.should_keep_alive(),
            http_version=self._parser.get_http_version(),
        )
        self._current = request
        expects_continue = False
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit() and int(value) > self._server.max_body_size:
                request.too_large = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expects_continue = True
        if request.too_large and not self._owing():
            self._write_and_close(400, self._server.too_large_body())  # refused before its body is read
        elif expects_continue and not request.too_large and self._transport is not None:
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._since = self._server.clock  # progress: the body timeout counts from the last byte
        request = self._current
        if request is None or request.too_large:
            return
        self._body_size += len(body)
        if self._body_size > self._server.max_body_size:
            request.too_large = True
            request.body.clear()  # the body is not kept: only its size mattered
        else:
            request.body.append(body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._since = self._server.clock
        request, self._current = self._current, None
        if request is None or self._closing:
            return
        if self._server.direct is not None and not self._owing() and not request.too_large \
                and request.rejection is None:
            body = b"".join(request.body) if len(request.body) != 1 else request.body[0]
            headers = dict(request.headers)
            if self._answer_direct(request, headers, body):
                request.body = []  # it may become a replay's request, which carries no body
                self._answered_directly = (request, headers, body)
                return
            request.body = [body]
        self._pending.append(request)
        ARRIVALS.in_transit += 1
        if self._idle:
            self._idle = False
            ARRIVALS.idle_clients -= 1
        if len(self._pending) > _MAX_PIPELINED and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        if self._owed is None and (self._worker is None or self._worker.done()):
            self._worker = self._loop.create_task(self._answer_pending())

    # ---- answering ------------------------------------------------------------------------------

    def _owing(self) -> bool:
        """Whether an answer is owed on this connection: a request waits, the task answers one, or the app will."""
        return bool(self._pending) or self._owed is not None or (
            self._worker is not None and not self._worker.done()
        )

    async def _answer_pending(self) -> None:
        """One task per busy connection answers its requests strictly in arrival order."""
        while self._pending and not self._closing:
            request = self._pending.popleft()
            if request.rejection is None:
                ARRIVALS.in_transit -= 1  # from here to its scheduler, the request's handling does not yield
            if self._paused and len(self._pending) <= _MAX_PIPELINED // 2 and self._transport is not None:
                self._transport.resume_reading()
                self._paused = False
            if request.too_large or request.rejection is not None:
                status, body = request.rejection or (400, self._server.too_large_body())
                self._write_and_close(status, body)
                return
            self._server.inflight += 1
            try:
                keep = await self._run_app(request)
            finally:
                self._server.inflight -= 1
            if not keep:
                self._close()
                return
            if self._server.stopping and not self._pending:
                self._close()
                return
        if not self._closing and not self._idle:  # answered: the client may send its next request
            self._idle = True
            ARRIVALS.idle_clients += 1

    async def _run_app(self, request: _Request) -> bool:
        body = b"".join(request.body) if len(request.body) != 1 else request.body[0]
        if self._server.direct is not None:
            return await self._respond(self._server.direct, request, body)
        scope = self._server.scope(request, self._client)
        if self._extensions is not None:
            scope["scheme"] = "https"
            scope["extensions"] = self._extensions
        delivered = False
        response = _ResponseWriter(self._transport, request)

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Future()  # like a connection that stays open: nothing more will arrive
            return {"type": "http.disconnect"}

        try:
            await self._server.app(scope, receive, response.send)
        except Exception:
            logger.exception("unhandled error in the HTTP application for %s %s", request.method, request.path)
            if not response.started:
                response.write_whole(500, b'{"error":"internal server error"}')
            return False
        if not response.complete:
            logger.error("the HTTP application returned without completing a response to %s", request.path)
            return False
        return request.keep_alive and not response.close_requested

    def _answer_direct(self, request: _Request, headers: dict[bytes, bytes], body: bytes) -> bool:
        """Answer a request without the connection's task, where the app can start it now (DirectApp.begin; called
        only when no earlier request of this connection is owed an answer): at once, or later through `_delivered`.
        False: the request was left untouched, to be answered in its turn (`_answer_pending`)."""
        app = cast(DirectApp, self._server.direct)  # only called where the server has one
        idle = self._idle
        if idle:  # counted before the app queues it: the client waits on an answer (a batch need not wait for it)
            self._idle = False
            ARRIVALS.idle_clients -= 1
        try:
            started = app.begin(
                request.method, request.path, headers, body, self._client, self._extensions,
                partial(self._delivered, request),
            )
        except Exception:
            self._fail(request)
            return True
        if started is not None and not isinstance(started, tuple):  # `_delivered` answers it
            self._owed = started
            self._server.inflight += 1
            return True
        if idle:
            self._idle = True
            ARRIVALS.idle_clients += 1
        if started is None:
            return False
        if not self._send(request, started) or self._server.stopping:
            self._close()
        return True

    def _delivered(self, request: _Request, answer: tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any]) -> None:
        """The answer to a request `begin` started and did not answer at once; then the requests pipelined behind it."""
        if self._owed is None:  # withdrawn: the client went away
            return
        self._owed = None
        self._server.inflight -= 1
        if not self._send(request, answer) or (self._server.stopping and not self._pending):
            self._close()
        elif self._pending:
            self._worker = self._loop.create_task(self._answer_pending())
        elif not self._closing and not self._idle:
            self._idle = True
            ARRIVALS.idle_clients += 1

    async def _respond(self, app: DirectApp, request: _Request, body: bytes) -> bool:
        """`_run_app` for an app that answers without ASGI's messages: one call, and the response in one write."""
        try:
            answer = await app.respond(
                request.method, request.path, dict(request.headers), body, self._client, self._extensions
            )
        except Exception:
            self._fail(request)
            return False
        return self._send(request, answer)

    def _fail(self, request: _Request) -> None:
        """Answer 500 for a request the app raised on (a bug: logged), then close."""
        logger.exception("unhandled error in the HTTP application for %s %s", request.method, request.path)
        _ResponseWriter(self._transport, request).write_whole(500, b'{"error":"internal server error"}')
        self._close()

    def _send(self, request: _Request, answer: tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any]) -> bool:
        """Write a DirectApp's answer in one write; whether the connection stays open."""
        status, payload, content_type, extra, trace = answer
        close = not request.keep_alive
        head = _head(status, content_type, len(payload))
        for name, value in extra:
            if name == b"connection":
                close = close or value.lower() == b"close"
            else:
                head += name + b": " + value + b"\r\n"
        head += b"connection: close\r\n\r\n" if close else b"\r\n"
        if trace is not None:
            trace.mark("HTTP_SEND_START")
        transport = self._transport
        if transport is not None and not transport.is_closing():
            if len(payload) <= _JOIN_BELOW:
                transport.write(head + payload)
            else:  # no copy of a large body: the transport sends both in one writev
                transport.writelines((head, payload))
        if trace is not None:
            trace.finish("HTTP_SEND_END")
        return not close

    def _reject(self, status: int, body: bytes) -> None:
        """Answer `status` and close; after the responses still owed on this connection, in their order."""
        self._stopped_reading = True
        if self._owing():
            self._pending.append(_Request("", "", b"", [], False, "1.1", rejection=(status, body)))
            if not self._paused and self._transport is not None:
                self._transport.pause_reading()
                self._paused = True
            return
        self._write_and_close(status, body)

    def _write_and_close(self, status: int, body: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            _ResponseWriter(self._transport, None).write_whole(status, body, close=True)
        self._close()

    def _close(self) -> None:
        self._closing = True
        self._drop_pending()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _drop_pending(self) -> None:
        ARRIVALS.in_transit -= sum(1 for request in self._pending if request.rejection is None)
        self._pending.clear()

    def gone(self) -> None:
        """The connection is closed (or never came up): it sends nothing more."""
        self._drop_pending()
        if self._idle:
            self._idle = False
            ARRIVALS.idle_clients -= 1
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def close_if_idle(self) -> None:
        if not self._owing():
            self._close()

    def expire(self, now: float, timeouts: tuple[float, float, float, float]) -> None:
        """Called by the sweep: close the connection if its phase has lasted longer than that phase's timeout."""
        if self._closing:
            return
        if self._owing():
            # A request under way is the application's time, not the client's: the clock restarts after it.
            self._since = now
            return
        if now - self._since < timeouts[self._phase]:
            return
        if self._phase == _HEAD:
            self._write_and_close(408, self._server.head_timeout_body)
        elif self._phase == _BODY:
            self._write_and_close(408, self._server.body_timeout_body)
        else:  # nothing was asked: a client between requests is closed without an answer, as keep-alive allows
            self._close()


def _head(status: int, content_type: bytes, length: int) -> bytes:
    """A response's status line and its content headers, each line ended (more headers may follow)."""
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
        status, _REASONS.get(status, b"Unknown"), content_type, length
    )


class _ResponseWriter:
    """Buffers `http.response.start` so a whole response leaves in one write (one syscall)."""

    def __init__(self, transport: asyncio.Transport | None, request: _Request | None) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._chunked = False
        self.started = False
        self.complete = False
        self.close_requested = request is not None and not request.keep_alive

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            status = message["status"]
            lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown"))]
            has_length = False
            for name, value in message.get("headers", ()):
                lowered = name.lower()
                if lowered == b"content-length":
                    has_length = True
                elif lowered == b"connection":  # written below, once, from what the server will do
                    self.close_requested = self.close_requested or value.lower() == b"close"
                    continue
                lines.append(name + b": " + value)
            if not has_length:
                self._chunked = True
                lines.append(b"transfer-encoding: chunked")
            if self.close_requested:
                lines.append(b"connection: close")
            self._head = b"\r\n".join(lines) + b"\r\n\r\n"
            self.started = True
        elif kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self._chunked:
                body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
            if self._head is not None:
                body, self._head = self._head + body, None
            if self._transport is not None and not self._transport.is_closing():
                self._transport.write(body)
            self.complete = not more

    def write_whole(self, status: int, body: bytes, close: bool = False) -> None:
        head = _head(status, b"application/json", len(body))
        if close:
            head += b"connection: close\r\n"
        if self._transport is not None:
            self._transport.write(head + b"\r\n" + body)
        self.started = self.complete = True


class NativeHttpServer:
    """Serves one ASGI app on host:port within `limits`; `started`, `serve()` and `should_exit` mirror
    uvicorn.Server."""

    def __init__(
        self, app: Any, host: str, port: int, max_body_size: int, limits: HttpLimits | None = None,
        tls: ServerTls | None = None, reuse_port: bool = False, adopting: bool = False,
    ) -> None:
        self.app = app
        self.direct: DirectApp | None = app if isinstance(app, DirectApp) else None
        # A connection replays a repeated request head (`_Replay`) unless the app's shortcuts are off.
        self.replay = self.direct is not None and self.direct.shortcuts
        self.tls = tls
        self.reuse_port = reuse_port  # several worker processes share the port (--workers)
        self.adopting = adopting  # binds nothing: serves the connections handed to `adopt` (--workers)
        self.host = host
        self.port = port
        self.max_body_size = max_body_size
        self.limits = limits = limits or HttpLimits()
        self.connections: set[_Connection] = set()
        self.inflight = 0
        self.started = False
        self.stopping = False
        self._stop = asyncio.Event()
        self._server_address: tuple[str, int] | None = None
        # Read by every request: plain attributes, with "off" (0) already turned into "no limit".
        self.max_header_size = limits.max_header_size if limits.max_header_size > 0 else math.inf
        self.max_header_count = limits.max_header_count if limits.max_header_count > 0 else math.inf
        self._max_connections = limits.max_connections if limits.max_connections > 0 else math.inf
        allowed = [f"{limit} {unit}" for limit, unit in
                   ((limits.max_header_size, "bytes"), (limits.max_header_count, "fields")) if limit > 0]
        message = (f"request header fields too large: at most {' in '.join(allowed)} "
                   "(--http-max-header-size, --http-max-header-count)")
        self.head_too_large = json.dumps({"error": message}, separators=(",", ":")).encode()
        self.head_timeout_body = (
            b'{"error":"request timeout: the request headers were not received within %g s '
            b'(--http-header-timeout-secs)"}' % limits.header_timeout
        )
        self.body_timeout_body = (
            b'{"error":"request timeout: the request body made no progress for %g s '
            b'(--http-body-timeout-secs)"}' % limits.body_timeout
        )
        # The sweep's period: a quarter of the shortest timeout, at most a second. Phases are timed on `clock`,
        # which only the sweep (and the accept loop) advance, so the start a phase records may be up to one period
        # earlier than its real start: each timeout gets one period more, so that no client is cut before its
        # timeout, and each is closed within two periods after it.
        enabled = [t for t in (limits.header_timeout, limits.idle_timeout, limits.body_timeout) if t > 0]
        self._sweep_period = min(1.0, max(0.01, min(enabled) / 4)) if enabled else 0.0
        # The handshake happens before the connection joins the sweep: the header timeout bounds it instead
        # (None: asyncio's default of 60 s, where the header timeout is off).
        self._handshake_timeout = limits.header_timeout if limits.header_timeout > 0 else None

        def bound(timeout: float) -> float:
            return timeout + self._sweep_period if timeout > 0 else math.inf

        header = bound(limits.header_timeout)
        self._timeouts = (header, header, bound(limits.body_timeout), bound(limits.idle_timeout))
        self.clock = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: list[socket.socket] = []
        self._accepting = False
        self._open = 0  # accepted sockets not yet closed: what the connection cap counts
        self._connecting: dict[asyncio.Task[Any], tuple[socket.socket, _Connection]] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _ACCEPT_RETRY_FIRST
        self._sweeper: asyncio.TimerHandle | None = None
        self._warned: dict[str, float] = {}

    @property
    def should_exit(self) -> bool:
        return self.stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self.stopping = True
            self._stop.set()

    def too_large_body(self) -> bytes:
        return (
            b'{"error":"request size exceeds the maximum allowed value of %d bytes; '
            b'use --http-max-input-size to increase the limit"}' % self.max_body_size
        )

    def scope(self, request: _Request, client: tuple[str, int] | None) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": client,
            "server": self._server_address,
        }

    async def serve(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.clock = loop.time()
        if self.adopting:  # the supervisor accepts and hands the connections over (`adopt`)
            self._server_address = (self.host, self.port)
        else:
            self._listeners = await bind_listeners(loop, self.host, self.port, 2048, self.reuse_port)
            sockname = self._listeners[0].getsockname()
            self._server_address = (str(sockname[0]), int(sockname[1]))
            self._resume_accepting()
        if self._sweep_period:
            self._sweeper = loop.call_later(self._sweep_period, self._sweep)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            self._pause_accepting()
            for listener in self._listeners:
                listener.close()
            self._listeners = []
            if self._retry is not None:
                self._retry.cancel()
            if self._connecting:  # connections accepted but not yet made: let them join the set closed below
                await asyncio.wait(list(self._connecting), timeout=1.0)
            for connection in list(self.connections):
                connection.close_if_idle()
            while self.inflight:
                await asyncio.sleep(0.01)
            for connection in list(self.connections):
                connection.close_if_idle()
            if self._sweeper is not None:
                self._sweeper.cancel()

    # ---- accepting ------------------------------------------------------------------------------
    #
    # Why not loop.create_server: its accept loop cannot be paused, and neither handles running out of file
    # descriptors well. asyncio logs and retries after a second, but uvloop leaves EMFILE to libuv, which
    # accepts and closes every pending connection (clients see resets: the "normal client reset"),
    # and a listen error it does report closes uvloop's server for good. Accepting here, the server can
    # stop accepting -- remove the listening socket from the loop -- at the connection cap or when descriptors
    # run out, and leave new connections waiting in the kernel's listen backlog, where a client sees a slow
    # connect rather than a refusal (accept-and-hold would spend a descriptor on each waiting client, the very
    # thing that is short). Accepting resumes as soon as a connection closes, or, when descriptors ran out,
    # after a back-off of 50 ms doubling to 1 s (they may be freed elsewhere): never a busy loop. The price is
    # a task per connection (connect_accepted_socket), paid once per connection, not per request.

    def _accept(self, listener: socket.socket) -> None:
        # One connection per readiness event: the listening socket stays readable while more wait (the loop
        # polls level-triggered), so the loop calls again after what else is ready, and a client connecting
        # alone does not pay for the failed accept (an exception) that draining the backlog ends with.
        loop = self._loop
        assert loop is not None
        self.clock = loop.time()
        if self._open >= self._max_connections:
            self._pause_accepting()
            self._warn("cap", "HTTP connections at --http-max-connections (%d): new ones wait in the backlog",
                       self.limits.max_connections)
            return
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return  # another listener's event, a spurious wake-up, or a client that gave up in the backlog
        except OSError as exc:
            # EMFILE / ENFILE (descriptors), ENOBUFS / ENOMEM: the pending connection stays in the backlog.
            # Anything else is unexpected; backing off all the same keeps a persistent error from spinning.
            self._pause_accepting()
            self._retry = loop.call_later(self._retry_delay, self._retry_accepting)
            self._warn("accept", "accepting HTTP connections paused for %.2f s: %s%s", self._retry_delay,
                       exc.strerror or exc, "" if exc.errno in _OUT_OF_RESOURCES else " (unexpected)")
            self._retry_delay = min(self._retry_delay * 2, _ACCEPT_RETRY_MAX)
            return
        self._retry_delay = _ACCEPT_RETRY_FIRST
        self._serve_socket(sock, None)

    def adopt(self, sock: socket.socket, on_close: Callable[[], None]) -> None:
        """Serve a connection another process accepted (the workers' supervisor, geserve/workers/dispatch.py);
        `on_close` is called once it closes."""
        if self.stopping:
            sock.close()
            on_close()
            return
        sock.setblocking(False)
        self._serve_socket(sock, on_close)

    def _serve_socket(self, sock: socket.socket, on_close: Callable[[], None] | None) -> None:
        loop = self._loop
        assert loop is not None
        self._open += 1
        connection = _Connection(self, on_close)
        if self.tls is None:
            task = loop.create_task(loop.connect_accepted_socket(lambda: connection, sock))
        else:  # the current context: a reload changes what the next connections get, not the open ones
            task = loop.create_task(loop.connect_accepted_socket(
                lambda: connection, sock, ssl=self.tls.context, ssl_handshake_timeout=self._handshake_timeout
            ))
        self._connecting[task] = (sock, connection)
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        sock, connection = self._connecting.pop(task)
        error = "cancelled" if task.cancelled() else task.exception()
        if error is not None and not connection.made:  # e.g. the client reset before the transport was made, or
            # a TLS handshake failed (a plaintext client, an untrusted or missing client certificate, a timeout)
            logger.debug("dropped an accepted HTTP connection: %s", error)
            connection.gone()
            sock.close()  # a no-op when the transport closed it already (both loops leave it detached, fd -1)
            self._open -= 1
            self._resume_accepting()

    def release(self, connection: _Connection) -> None:
        """A connection closed: one place under the cap, and one descriptor, are free again."""
        self.connections.discard(connection)
        self._open -= 1
        self._resume_accepting()

    def _pause_accepting(self) -> None:
        if self._accepting and self._loop is not None:
            for listener in self._listeners:
                self._loop.remove_reader(listener.fileno())
            self._accepting = False

    def _resume_accepting(self) -> None:
        if self._accepting or self.stopping or self._loop is None or self._open >= self._max_connections:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for listener in self._listeners:
            self._loop.add_reader(listener.fileno(), self._accept, listener)
        self._accepting = True

    def _retry_accepting(self) -> None:
        self._retry = None
        self._resume_accepting()

    def _warn(self, kind: str, message: str, *args: object) -> None:
        if self.clock - self._warned.get(kind, -math.inf) >= _WARN_EVERY:
            self._warned[kind] = self.clock
            logger.warning(message, *args)

    # ---- timeouts -------------------------------------------------------------------------------

    def _sweep(self) -> None:
        assert self._loop is not None
        now = self.clock = self._loop.time()
        timeouts = self._timeouts
        for connection in list(self.connections):  # a copy: closing may run connection_lost at once
            connection.expire(now, timeouts)
        self._sweeper = self._loop.call_later(self._sweep_period, self._sweep)


async def bind_listeners(
    loop: asyncio.AbstractEventLoop, host: str, port: int, backlog: int, reuse_port: bool = False
) -> list[socket.socket]:
    """Listening sockets for host:port, as loop.create_server binds them (every address host resolves to); with
    `reuse_port`, sockets other processes of the server bind too (SO_REUSEPORT: the kernel spreads connections)."""
    infos = await loop.getaddrinfo(
        host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # as asyncio: a family this host lacks (IPv6 turned off) is skipped
                logger.debug("skipping %r: cannot create a socket of its family", address)
                continue
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # as asyncio: an IPv6 socket does not also take the IPv4 port
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                reason = (exc.strerror or str(exc)).lower()
                raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: {reason}") from None
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    if not listeners:
        raise OSError(f"no address to listen on for {host!r}")
    return listeners
