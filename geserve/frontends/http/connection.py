"""One connection of the native HTTP/1.1 server (native_server.py): a state machine that reads requests, parsed by
httptools or replayed (replay.py), and its responder, which answers them strictly in arrival order.

Reading and answering overlap (a pipelining client sends its next requests before the first is answered), so each
side has its own state: the connection's `State` says where the client is in its stream of requests, and picks the
timeout that applies; the responder's `Turn` says who answers the oldest request not yet answered.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol, cast
from urllib.parse import unquote

import httptools

from geserve.arrivals import ARRIVALS
from geserve.frontends.http.messages import Answer, DirectApp, Request, ResponseWriter, response_head
from geserve.frontends.http.replay import HeadReplay
from geserve.frontends.tls import ServerTls, asgi_tls_extension

logger = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 64  # requests parsed ahead of the one being answered before reading pauses
_JOIN_BELOW = 64 * 1024  # response bodies up to this size are joined to their head (one buffer, one write)
# Most bytes one data_received call can carry (asyncio's and uvloop's read size): a head still incomplete after
# a read may have counted up to this many bytes of the previous request, so the raw guard allows for them.
_READ_SLACK = 256 * 1024


class State(Enum):
    """Where a connection is in its client's stream of requests (the table in HttpConnection's docstring)."""

    NEW = "connected, nothing read yet"
    HEAD = "reading a request's line and headers"
    BODY = "reading a request's body"
    HELD = "a replayed head and the start of its body held, the rest on its way"
    IDLE = "between two requests"
    REJECTING = "a 400 or 431 owed after the answers before it; nothing more is read"
    CLOSED = "closing or closed; nothing more is read or written"


class Turn(Enum):
    """Who answers a connection's oldest request not yet answered (the table in Responder's docstring)."""

    NOBODY = "no answer is owed"
    APP = "the app, through the callback DirectApp.begin was given"
    TASK = "the connection's task"


# Module names for the states, as the read path tests them (`state is IDLE`): a global's load, no attribute lookup.
NEW, HEAD, BODY, HELD, IDLE, REJECTING, CLOSED = State
NOBODY, APP, TASK = Turn


class Host(Protocol):
    """What a connection reads of its server (NativeHttpServer), and the counts it keeps there."""

    app: Any
    direct: DirectApp | None
    replay: bool
    tls: ServerTls | None
    connections: set[HttpConnection]
    clock: float  # the server's coarse clock, which times each state
    inflight: int  # requests the app is answering, on every connection
    stopping: bool
    max_body_size: int
    max_header_size: float
    max_header_count: float
    head_too_large: bytes  # the 431 answer's body, and the 408 answers' below
    head_timeout_body: bytes
    body_timeout_body: bytes

    def release(self, connection: HttpConnection) -> None: ...

    def too_large_body(self) -> bytes: ...

    def scope(self, request: Request, client: tuple[str, int] | None) -> dict[str, Any]: ...


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over the limits (answered 431)."""


class HttpConnection(asyncio.Protocol):
    """Reads a client's requests and hands each, read whole, to its `Responder`, which answers them in order.

    | state     | timeout          | moved on by                                                                    |
    |-----------|------------------|--------------------------------------------------------------------------------|
    | NEW       | header, silent   | a request's first bytes: HEAD (the parser's `on_message_begin`)                |
    | HEAD      | header, 408      | its head whole and within the limits: BODY (`on_headers_complete`)             |
    | BODY      | body, 408        | its body whole: IDLE, the request handed to the responder                      |
    | IDLE      | idle, silent     | with no answer owed, the replay's head again: IDLE (answered, `HeadReplay`) or |
    |           |                  | HELD (its body partly read); any other bytes: HEAD, through the parser         |
    | HELD      | body, 408        | the rest of its body: IDLE (answered); bytes that do not fit: IDLE, and parsed |
    |           |                  | with the held ones                                                             |
    | REJECTING | -- (answer owed) | the answers owed before its rejection, then the rejection: CLOSED              |
    | CLOSED    | --               | --                                                                             |

    Bytes httptools refuses (400) or a head over the limits (431) move a reading state to REJECTING where answers are
    owed before the rejection's, else to CLOSED once it is written. Any state moves to CLOSED when the client goes
    (`connection_lost`), its timeout passes (`expire`), an answer closes the connection (`Connection: close`, HTTP/1.0,
    a failing app, the server stopping) or the server stops (`close_if_idle`). A timeout counts from when the state
    began (BODY: from the last byte read) on the server's coarse clock, and only while no answer is owed: a request
    under way is the application's time, not the client's.
    """

    def __init__(self, server: Host, on_close: Callable[[], None] | None = None) -> None:
        self._server = server
        self._on_close = on_close  # an adopted connection's: its supervisor counts it
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self.state = NEW
        self._since = server.clock  # when the state began, on the server's coarse clock (see NativeHttpServer.clock)
        self.made = False
        self._responder = Responder(self, server)
        self._direct = server.direct is not None  # whether a request read whole may be answered in the read
        self._replay = HeadReplay(self._responder.direct) if server.replay else None
        self._answered: tuple[Request, dict[bytes, bytes], bytes] | None = None  # directly, in this read: to learn
        self._messages = 0  # requests begun
        # The request being parsed
        self._current: Request | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body_size = 0
        self._head_size = 0  # bytes of the header names and values (for the 431 check)
        self._head_raw = 0  # bytes read while a head stays incomplete (bounds a header that never ends)
        ARRIVALS.connected()

    # ---- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.made = True
        peer = transport.get_extra_info("peername")  # once: uvloop asks the socket (a syscall) every time
        client = (peer[0], peer[1]) if peer else None
        tls = self._server.tls
        # Called once the handshake is done: the peer's certificate is known.
        extensions = None if tls is None else {"tls": asgi_tls_extension(transport, tls.mutual)}
        self._responder.made(self._transport, client, extensions)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.release(self)
        self.state = CLOSED
        self.gone()
        self._responder.lost()

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is CLOSED or state is REJECTING:
            return
        replay = self._replay
        if replay is not None:
            if (state is IDLE or state is HELD) and self._responder.turn is NOBODY:
                self.state = IDLE  # what the replay holds, the parser never saw
                rest = replay.offer(data, self._messages)
                if rest is None:  # answered, or the start of a replayed request held until its body is whole
                    self._since = self._server.clock
                    if replay.held:
                        self.state = HELD
                    return
                data = rest
            else:
                replay.record(data, state is IDLE or state is NEW, self._messages)
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._refuse(exc)
            return
        if self.state is HEAD:
            # httptools buffers a header field until it ends; a field that never ends is stopped here.
            self._head_raw += len(data)
            if self._head_raw > self._server.max_header_size + _READ_SLACK:
                self._reject(431, self._server.head_too_large)
        answered, replay = self._answered, self._replay
        if answered is not None and replay is not None:
            self._answered = None
            replay.learn(self._messages, self.state is IDLE, answered)

    def _refuse(self, exc: Exception) -> None:
        """Answer a read httptools refused, and close."""
        if isinstance(exc, httptools.HttpParserUpgrade):
            self._reject(400, b'{"error":"protocol upgrades are not supported"}')
        elif isinstance(exc.__context__, _HeadTooLarge):
            self._reject(431, self._server.head_too_large)
        else:
            self._reject(400, b'{"error":"malformed HTTP request: %s"}' % str(exc).encode(errors="replace"))

    def _reject(self, status: int, body: bytes) -> None:
        """Answer `status` and close; after the responses still owed on this connection, in their order."""
        if self.state is CLOSED:  # closed by an answer earlier in the read: nothing more is written
            return
        self.state = REJECTING
        if self._responder.turn is NOBODY:
            self._responder.write_and_close(status, body)
        else:
            self._responder.reject(status, body)

    # ---- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._messages += 1
        self._url = b""
        self._headers = []
        self._body_size = 0
        self._head_size = self._head_raw = 0
        state = self.state
        if state is IDLE:
            self._since = self._server.clock
            self.state = HEAD
        elif state is NEW:  # a new connection's head is timed from connecting, not from its first byte
            self.state = HEAD

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._head_size += len(name) + len(value)

    def on_headers_complete(self) -> None:
        # C: every parsed request's head, its limits, target and headers checked in one call (the parse path's cost)
        # The head's limits, checked once it is whole (the raw guard in _parse bounds it until then).
        server = self._server
        headers = self._headers
        count = len(headers)
        url = self._url
        if count > server.max_header_count or len(url) + self._head_size + 4 * count > server.max_header_size:
            raise _HeadTooLarge
        if self.state is HEAD:
            self.state = BODY
        self._since = server.clock
        if b"?" in url or b"%" in url or b"#" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            path, query = unquote(parsed.path.decode(errors="replace")), parsed.query or b""
        else:  # the usual request path: nothing to split off or decode
            path, query = url.decode(errors="replace"), b""
        parser = self._parser
        request = self._current = Request(
            parser.get_method().decode(), path, query, headers, parser.should_keep_alive(), parser.get_http_version()
        )
        expects_continue = False
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > server.max_body_size:
                request.too_large = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expects_continue = True
        if request.too_large or expects_continue:
            self._before_body(request, expects_continue)

    def _before_body(self, request: Request, expects_continue: bool) -> None:
        """A head read whose body is over the size limit, or that the client sends once told to (100-continue)."""
        if request.too_large and self._responder.turn is NOBODY:
            self._responder.write_and_close(400, self._server.too_large_body())  # refused before its body is read
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
        request, self._current = self._current, None
        if self.state is CLOSED:
            return
        self.state = IDLE
        self._since = self._server.clock
        if request is None:
            return
        responder = self._responder
        if self._direct and responder.turn is NOBODY and not request.too_large:
            body = b"".join(request.body) if len(request.body) != 1 else request.body[0]
            headers = dict(request.headers)
            if responder.direct(request, headers, body):
                request.body = []  # it may become the replay's request, which carries no body
                if self._replay is not None:
                    self._answered = (request, headers, body)
                return
            request.body = [body]
        responder.queue(request)

    # ---- closing and timeouts ------------------------------------------------------------------

    def close(self) -> None:
        """Nothing more is read or written: the requests waiting for an answer are dropped, the transport closes."""
        self.state = CLOSED
        self._responder.drop()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def gone(self) -> None:
        """The connection is closed (or never came up): it sends nothing more."""
        self._responder.gone()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def close_if_idle(self) -> None:
        if self._responder.turn is NOBODY:
            self.close()

    def expire(self, now: float, timeouts: dict[State, float]) -> None:
        """Called by the sweep: close the connection if its state has lasted longer than that state's timeout."""
        state = self.state
        if state is CLOSED:
            return
        if self._responder.turn is not NOBODY:
            # A request under way is the application's time, not the client's: the clock restarts after it.
            self._since = now
            return
        if now - self._since < timeouts[state]:
            return
        if state is HEAD:
            self._responder.write_and_close(408, self._server.head_timeout_body)
        elif state is BODY or state is HELD:
            self._responder.write_and_close(408, self._server.body_timeout_body)
        else:  # nothing was asked: a client between requests is closed without an answer, as keep-alive allows
            self.close()


class Responder:
    """Answers a connection's requests strictly in arrival order, and keeps the counts that follow them (ARRIVALS,
    the server's `inflight`). A request read while no answer is owed is answered directly (`direct`: DirectApp.begin,
    from the read callback): at once, or later through the callback `begin` was given (`_delivered`). Any other
    (an app without `begin`, a request `begin` leaves alone, or one read while an answer is owed) waits in `_pending`
    for the connection's task (`_answer_pending`), one task per busy connection.

    | turn   | the oldest request unanswered is answered by | moved on by                                          |
    |--------|----------------------------------------------|------------------------------------------------------|
    | NOBODY | -- (none is owed)                            | begin will answer later: APP; a request queued: TASK |
    | APP    | the app, through `_delivered`                | its answer: TASK if requests wait, else NOBODY;      |
    |        |                                              | the client went (withdrawn): NOBODY                  |
    | TASK   | the connection's task                        | none waits, or the connection closed: NOBODY         |
    """

    __slots__ = ("_app", "_client", "_connection", "_deliver", "_extensions", "_idle", "_loop", "_owed", "_paused",
                 "_pending", "_server", "_transport", "_withdraw", "_worker", "turn")

    def __init__(self, connection: HttpConnection, server: Host) -> None:
        self._connection = connection
        self._server = server
        self._app = cast(DirectApp, server.direct)  # called only where the server has one
        self._loop = asyncio.get_running_loop()  # kept: each lookup costs a getpid() system call
        self._transport: asyncio.Transport | None = None
        self._client: tuple[str, int] | None = None
        self._extensions: dict[str, Any] | None = None  # HTTPS: the scope's "extensions", made once per connection
        self.turn = NOBODY
        self._pending: collections.deque[Request] = collections.deque()
        self._worker: asyncio.Task[None] | None = None
        self._owed: Request | None = None  # the request the app answers later (APP)
        self._withdraw: Callable[[], None] | None = None  # withdraws it (DirectApp.begin)
        self._deliver = self._delivered  # bound once: begin's callback costs a request no allocation
        self._paused = False  # reading paused: too many requests wait, or a rejection does
        # Counted in ARRIVALS.idle_clients while it may send a request (from its accept until it closes, except
        # while a request of its is under way): a batcher waits for no request while every client waits on one.
        self._idle = True

    def made(self, transport: asyncio.Transport, client: tuple[str, int] | None,
             extensions: dict[str, Any] | None) -> None:
        self._transport = transport
        self._client = client
        self._extensions = extensions

    # ---- answering directly --------------------------------------------------------------------

    def direct(self, request: Request, headers: dict[bytes, bytes], body: bytes) -> bool:
        """Answer a request without the task, where the app can start it now (DirectApp.begin; called only when no
        answer is owed): at once, or later through `_delivered`. False: the request was left untouched, to be
        queued."""
        idle = self._idle
        if idle:  # counted before the app queues it: the client waits on an answer (a batch need not wait for it)
            self._idle = False
            ARRIVALS.idle_clients -= 1
        try:
            started = self._app.begin(
                request.method, request.path, headers, body, self._client, self._extensions, self._deliver
            )
        except Exception:
            self._fail(request)
            return True
        if started is not None and not isinstance(started, tuple):  # `_delivered` answers it
            self._owed, self._withdraw = request, started
            self.turn = APP
            self._server.inflight += 1
            return True
        if idle:
            self._idle = True
            ARRIVALS.idle_clients += 1
        if started is None:
            return False
        if not self._send(request, started) or self._server.stopping:
            self._connection.close()
        return True

    def _delivered(self, answer: Answer) -> None:
        """The answer to the request `begin` started and did not answer at once; then the requests queued behind it."""
        request = self._owed
        if request is None:  # withdrawn: the client went away
            return
        self._owed = self._withdraw = None
        self.turn = NOBODY
        self._server.inflight -= 1
        if not self._send(request, answer) or (self._server.stopping and not self._pending):
            self._connection.close()
        elif self._pending:
            self._start()
        else:
            self._answered()

    # ---- answering in the task -----------------------------------------------------------------

    def queue(self, request: Request) -> None:
        """A request read whole, to be answered by the task in its turn."""
        pending = self._pending
        pending.append(request)
        ARRIVALS.in_transit += 1
        if self._idle:
            self._idle = False
            ARRIVALS.idle_clients -= 1
        if len(pending) > _MAX_PIPELINED and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        if self.turn is NOBODY:
            self._start()

    def reject(self, status: int, body: bytes) -> None:
        """Answer `status` after the answers owed (then close); nothing more is read meanwhile."""
        self._pending.append(Request("", "", b"", [], False, "1.1", rejection=(status, body)))
        if not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True

    def _start(self) -> None:
        """Requests wait with no answer owed before them: the task answers them."""
        self.turn = TASK
        self._worker = self._loop.create_task(self._answer_pending())

    async def _answer_pending(self) -> None:
        """The connection's task: answers the waiting requests, in arrival order."""
        pending, server = self._pending, self._server
        try:
            while pending:  # closing empties it
                request = pending.popleft()
                if request.rejection is None:
                    ARRIVALS.in_transit -= 1  # from here to its scheduler, the request's handling does not yield
                if self._paused:
                    self._resume()
                if request.too_large or request.rejection is not None:
                    self.write_and_close(*(request.rejection or (400, server.too_large_body())))
                    return
                server.inflight += 1
                try:
                    keep = await self._run_app(request)
                finally:
                    server.inflight -= 1
                if not keep or (server.stopping and not pending):
                    self._connection.close()
                    return
            self._answered()
        finally:
            self.turn = NOBODY

    def _resume(self) -> None:
        """Reading was paused (too many requests waiting, or a rejection): it resumes once half the limit waits."""
        if len(self._pending) <= _MAX_PIPELINED // 2 and self._transport is not None:
            self._transport.resume_reading()
            self._paused = False

    def _answered(self) -> None:
        """Every request answered: the client may send its next request."""
        if self._connection.state is not CLOSED and not self._idle:
            self._idle = True
            ARRIVALS.idle_clients += 1

    async def _run_app(self, request: Request) -> bool:
        body = b"".join(request.body) if len(request.body) != 1 else request.body[0]
        if self._server.direct is not None:
            return await self._respond(self._server.direct, request, body)
        scope = self._server.scope(request, self._client)
        if self._extensions is not None:
            scope["scheme"] = "https"
            scope["extensions"] = self._extensions
        delivered = False
        response = ResponseWriter(self._transport, request)

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

    async def _respond(self, app: DirectApp, request: Request, body: bytes) -> bool:
        """`_run_app` for an app that answers without ASGI's messages: one call, and the response in one write."""
        try:
            answer = await app.respond(
                request.method, request.path, dict(request.headers), body, self._client, self._extensions
            )
        except Exception:
            self._fail(request)
            return False
        return self._send(request, answer)

    # ---- writing -------------------------------------------------------------------------------

    def _send(self, request: Request, answer: Answer) -> bool:
        """Write a DirectApp's answer in one write; whether the connection stays open."""
        status, payload, content_type, extra, trace = answer
        close = not request.keep_alive
        head = response_head(status, content_type, len(payload))
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

    def _fail(self, request: Request) -> None:
        """Answer 500 for a request the app raised on (a bug: logged), then close."""
        logger.exception("unhandled error in the HTTP application for %s %s", request.method, request.path)
        ResponseWriter(self._transport, request).write_whole(500, b'{"error":"internal server error"}')
        self._connection.close()

    def write_and_close(self, status: int, body: bytes) -> None:
        """Answer `status` with `body` (JSON) and close the connection."""
        if self._transport is not None and not self._transport.is_closing():
            ResponseWriter(self._transport, None).write_whole(status, body, close=True)
        self._connection.close()

    # ---- the end -------------------------------------------------------------------------------

    def drop(self) -> None:
        """Nothing more is answered (the connection closes): the requests waiting are dropped."""
        ARRIVALS.in_transit -= sum(1 for request in self._pending if request.rejection is None)
        self._pending.clear()

    def gone(self) -> None:
        """The connection is closed (or never came up): its client sends nothing more."""
        self.drop()
        if self._idle:
            self._idle = False
            ARRIVALS.idle_clients -= 1

    def lost(self) -> None:
        """The client went away: what is under way for it is cancelled, and nothing is written."""
        if self._worker is not None and not self._worker.done():
            # The client went away with a request under way: cancelling the connection's one task cancels the
            # service call it awaits (a queued request leaves its scheduler, counted CANCELED), and nothing is written.
            # No per-request watcher: the ASGI receive channel would need a second task per request to notice this.
            self._worker.cancel()
        withdraw = self._withdraw
        if withdraw is not None:  # the same for a request the app answers later: withdrawn
            self._owed = self._withdraw = None
            self.turn = NOBODY
            self._server.inflight -= 1
            withdraw()
