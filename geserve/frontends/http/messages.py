"""What a native HTTP/1.1 connection hands on and writes back: the request read (`Request`), the app that answers it
in one call (`DirectApp`, beside plain ASGI), and the bytes of a response (`response_head`, `ResponseWriter`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

REASONS = {
    100: b"Continue", 200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
    408: b"Request Timeout", 409: b"Conflict", 413: b"Payload Too Large", 431: b"Request Header Fields Too Large",
    500: b"Internal Server Error", 501: b"Not Implemented", 503: b"Service Unavailable",
}

# A DirectApp's answer: status, body, content type, more headers, and a trace to mark "HTTP_SEND_START" and finish
# once it is written (or None).
Answer = tuple[int, bytes, bytes, list[tuple[bytes, bytes]], Any]


@runtime_checkable
class DirectApp(Protocol):
    """An ASGI app that also answers a request in one call, without ASGI's scope and messages (the inference
    frontend: geserve/frontends/http/app.py); the server then calls `respond` instead, ~10 µs less per request."""

    shortcuts: bool
    """Whether the request path's shortcuts are on (--inference-shortcuts): the connection's replay is one."""

    async def respond(
        self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
        client: tuple[str, int] | None, extensions: dict[str, Any] | None,
    ) -> Answer:
        """(status, body, content type, more headers, a trace to mark "HTTP_SEND_START" and finish or None)."""
        ...

    def begin(
        self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
        client: tuple[str, int] | None, extensions: dict[str, Any] | None,
        deliver: Callable[[Answer], None],
    ) -> Answer | Callable[[], None] | None:
        """`respond` without a task, where the app can start the request now: its answer when it has one at once,
        else the call that withdraws it (the client went away: `deliver` is then never called), `deliver` being
        called (once, from a later turn of the loop) with its answer. None (having done nothing) elsewhere."""
        ...


@dataclass(slots=True)
class Request:
    """A request read whole (or, with `rejection`, the stand-in for one that could not be read)."""

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


def response_head(status: int, content_type: bytes, length: int) -> bytes:
    """A response's status line and its content headers, each line ended (more headers may follow)."""
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
        status, REASONS.get(status, b"Unknown"), content_type, length
    )


class ResponseWriter:
    """Buffers `http.response.start` so a whole response leaves in one write (one syscall)."""

    def __init__(self, transport: asyncio.Transport | None, request: Request | None) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._chunked = False
        self.started = False
        self.complete = False
        self.close_requested = request is not None and not request.keep_alive

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI's `send`."""
        kind = message["type"]
        if kind == "http.response.start":
            self._start(message)
        elif kind == "http.response.body":
            self._body(message)

    def _start(self, message: dict[str, Any]) -> None:
        status = message["status"]
        lines = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Unknown"))]
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

    def _body(self, message: dict[str, Any]) -> None:
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
        head = response_head(status, b"application/json", len(body))
        if close:
            head += b"connection: close\r\n"
        if self._transport is not None:
            self._transport.write(head + b"\r\n" + body)
        self.started = self.complete = True
