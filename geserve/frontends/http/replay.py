"""A native HTTP connection's replayed request head (`HeadReplay`): a client that repeats one kind of request gets it
answered without httptools."""

from __future__ import annotations

from collections.abc import Callable

from geserve.frontends.http.messages import Request

# Largest request (head and body) a connection replays: parsing a larger one costs little beside its bytes, and its
# reads are not joined.
REPLAY_MAX = 64 * 1024
_NOTHING = Request("", "", b"", [], False, "1.1")  # the request of a replay that learnt none (no read matches it)


class HeadReplay:
    """A request head this connection sent, and the request the app answered directly from it. Parsing is a function
    of the bytes, so later reads that are the same head and a body of the same length (a client repeating one kind of
    request: perf_analyzer, tritonclient) are that request again with the new body: answered (`answer`, the
    connection's direct answer) without httptools, its callbacks and a new `Request` (about a third of a directly
    answered request's Python). The body may come in later reads (libcurl sends the head and the body apart: they are
    `held` until it is whole); anything else is parsed.

    The connection offers it each read that comes while no answer is owed (`offer`); it records the other reads the
    parser is fed (`record`), and learns a head from the reads of one whole request the app answered directly
    (`learn`): only a head whose body is the raw bytes read (Content-Length, no transfer coding) and that asks nothing
    of the server while its body is read (no `Expect`).
    """

    __slots__ = ("_answer", "_head", "_headers", "_raw", "_raw_begun", "_request", "_size", "held")

    def __init__(self, answer: Callable[[Request, dict[bytes, bytes], bytes], bool]) -> None:
        self.held = b""
        """The learnt head and the part of its body read so far, while the rest is on its way (b"": nothing)."""
        self._answer = answer  # answers a request directly; False: the app left it alone (it is then parsed)
        self._head = b""
        self._size = -1  # the head and its body (the head's Content-Length); -1: nothing learnt, no read matches
        self._request = _NOTHING  # its body list is left empty: the body travels beside it
        self._headers: dict[bytes, bytes] = {}
        self._raw: bytes | None = None  # the reads since a request began at the start of one (to learn from)
        self._raw_begun = 0  # the requests the connection had begun before them

    @property
    def learnt(self) -> bool:
        """Whether it learnt a head (the reads that repeat it are replayed)."""
        return self._size >= 0

    def offer(self, data: bytes, messages: int) -> bytes | None:
        """A read that came while no answer is owed, after what is `held`: None where it was taken (the learnt request
        again, answered; or its start, held until its body is whole), else the bytes to parse from the start of a
        request (recorded as `record` does; `messages`: the requests the connection has begun)."""
        if self.held:
            data, self.held = self.held + data, b""
        size = self._size
        if len(data) <= size and data.startswith(self._head):
            if len(data) < size:  # the body is on its way
                self.held = data
                return None
            if self._answer(self._request, self._headers, data[len(self._head):]):
                return None
            self._forget()  # the app routes it now (a model reloaded, unloaded, ...): parsed as any other
        self._raw, self._raw_begun = (data if len(data) <= REPLAY_MAX else None), messages
        return data

    def record(self, data: bytes, fresh: bool, messages: int) -> None:
        """A read the parser is fed that was not offered: `fresh` where it starts a request (the connection was new or
        between requests; `messages`: the requests it had begun), else more of the reads being recorded."""
        if fresh:
            self._raw, self._raw_begun = (data if len(data) <= REPLAY_MAX else None), messages
        elif self._raw is not None:
            self._raw = self._raw + data if len(self._raw) + len(data) <= REPLAY_MAX else None

    def learn(self, messages: int, idle: bool, answered: tuple[Request, dict[bytes, bytes], bytes]) -> None:
        """After a read that ended a request the app answered directly (`answered`: it, its headers and its body):
        learn its head where the reads recorded since are that request alone (`messages`: the requests the connection
        has begun; `idle`: none begun after it)."""
        raw, one = self._raw, messages == self._raw_begun + 1
        if raw is None or (one and not idle):  # nothing recorded, or the reads of its one request go on
            return
        self._raw = None
        request, headers, body = answered
        if not (one and idle) or b"content-length" not in headers or b"transfer-encoding" in headers \
                or b"expect" in headers:
            return
        head = raw[: len(raw) - len(body)]
        if head.endswith(b"\r\n\r\n"):
            self._head, self._size, self._request, self._headers = head, len(raw), request, headers

    def _forget(self) -> None:
        self._head, self._size, self._request, self._headers = b"", -1, _NOTHING, {}
