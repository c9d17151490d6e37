"""geserve's native HTTP/1.1 server at the socket level: pipelining, chunked bodies, 100-continue, limits."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

from geserve.frontends.http.app import Receive, Send
from geserve.frontends.http.native_server import NativeHttpServer
from tests.support.server import RunningServer, geserve

INFER = json.dumps({"inputs": [
    {"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for n in ("INPUT0", "INPUT1")
]}).encode()


def _connect(server: RunningServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=10)


def _read_responses(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Read `count` Content-Length responses off the socket, in order."""
    buffer = b""
    responses = []
    while len(responses) < count:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {len(responses)} responses: {buffer!r}")
            buffer += chunk
        head, buffer = buffer.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        if status == 100:
            continue
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        length = int(headers[b"content-length"])
        while len(buffer) < length:
            buffer += sock.recv(65536)
        responses.append((status, buffer[:length]))
        buffer = buffer[length:]
    return responses


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the test fails on the timeout if not)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def test_pipelined_requests_are_answered_in_order(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            _request("POST", "/v2/models/simple/infer", INFER)
            + _request("GET", "/v2/models/nope")
            + _request("GET", "/v2/health/live")
            + _request("POST", "/v2/models/simple/infer", INFER)
        )
        statuses = [status for status, _ in _read_responses(sock, 4)]
    assert statuses == [200, 404, 200, 200]


def test_chunked_request_body(server: RunningServer) -> None:
    chunks = [INFER[:10], INFER[10:50], INFER[50:]]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        ((status, answer),) = _read_responses(sock, 1)
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2 * i for i in range(16)]


def test_expect_100_continue(server: RunningServer) -> None:
    with _connect(server) as sock:
        head = _request("POST", "/v2/models/simple/infer", b"", "Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", b"Content-Length: %d" % len(INFER)
        )
        sock.sendall(head)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(INFER)
        ((status, _),) = _read_responses(sock, 1)
    assert status == 200


def test_http_1_0_closes_after_the_response(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"GET /v2/health/ready HTTP/1.0\r\n\r\n")
        data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200")


def test_malformed_request_is_400_and_closed(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 400")


def test_oversized_body_refused_before_it_is_sent(good_repo: Path, tmp_path: Path) -> None:
    with geserve([good_repo], tmp_path / "log", ["--http-max-input-size=1000"]) as server, _connect(server) as sock:
        sock.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n")
        data = _read_until_closed(sock)  # the server answers and closes without waiting for 5 MB
        assert data.startswith(b"HTTP/1.1 400") and b"--http-max-input-size" in data


def test_a_malformed_request_after_a_good_one_is_answered_in_turn(server: RunningServer) -> None:
    """The 400 for a request that does not parse waits for the answer owed before it, then the connection closes."""
    with _connect(server) as sock:
        sock.sendall(_request("POST", "/v2/models/simple/infer", INFER) + b"THIS IS NOT HTTP\r\n\r\n")
        # Both answers may come in one read: take the first off everything the server sends before closing.
        head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
        status = int(head.split()[1])
        length = int(dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])[b"content-length"])
        answer, rest = body[:length], body[length:]
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2 * i for i in range(16)]
    assert rest.startswith(b"HTTP/1.1 400")


def test_a_client_asking_to_close_gets_one_connection_header_and_a_close(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(_request("POST", "/v2/models/simple/infer", INFER, "Connection: close\r\n"))
        data = _read_until_closed(sock)
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and head.count(b"connection: close") == 1


def test_an_asgi_app_asking_to_close_gets_one_connection_header() -> None:
    """The ASGI path (apps without `respond`, such as the metrics app): the app's own `connection: close` is written
    once, and the connection closes after the response."""
    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> bytes:
        http = NativeHttpServer(app, "127.0.0.1", 0, 1 << 20)
        serving = asyncio.ensure_future(http.serve())
        while not http.started:
            await asyncio.sleep(0.01)
        assert http._server_address is not None
        reader, writer = await asyncio.open_connection(*http._server_address)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closes
        writer.close()
        http.should_exit = True
        await serving
        return data

    data = asyncio.run(main())
    assert data.startswith(b"HTTP/1.1 200") and data.lower().count(b"connection: close") == 1 and data.endswith(b"ok")
