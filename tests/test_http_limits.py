"""Connection limits with real sockets (issue 12): slow, idle and hostile clients against a real geserve process.

HTTP (the native server): header-read, idle keep-alive and body timeouts, header size and count (431), the
connection cap (new connections wait in the backlog), and running out of file descriptors (no spinning, no
reset clients, recovery). gRPC: Triton's keepalive flags and the stream cap, read off the wire with a few raw
HTTP/2 frames. Every wait is bounded; the servers run with timeouts of a second or a few.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from geserve.frontends.grpc.server import GrpcOptions
from geserve.frontends.http.native_server import HttpLimits, NativeHttpServer
from geserve.frontends.http.server import create_http_server
from tests.support.server import RunningServer, geserve

INFER = json.dumps({"inputs": [
    {"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for n in ("INPUT0", "INPUT1")
]}).encode()
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
TIMEOUT = 1.0  # the HTTP timeouts of the `limited` server
# A limit acts within its timeout plus two sweep periods (a quarter of the shortest timeout each); the upper
# bound allows for a loaded machine.
EARLIEST, LATEST = TIMEOUT - 0.05, TIMEOUT + 1.5
HELD_CAP = 250  # --http-max-connections of the `held` server


@pytest.fixture(scope="module")
def limited(good_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Short HTTP timeouts and small header limits; gRPC with Triton's defaults."""
    args = ["--http-header-timeout-secs", str(TIMEOUT), "--http-idle-timeout-secs", str(TIMEOUT),
            "--http-body-timeout-secs", str(TIMEOUT), "--http-max-header-size", "8192",
            "--http-max-header-count", "32"]
    with geserve([good_repo], tmp_path_factory.mktemp("limited") / "geserve.log", args) as running:
        yield running


@pytest.fixture(scope="module")
def held(good_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A header timeout long enough to hold slow clients through a test, a connection cap, gRPC flags set."""
    args = ["--http-header-timeout-secs", "10", "--http-max-connections", str(HELD_CAP),
            "--grpc-max-concurrent-streams", "3", "--grpc-http2-max-ping-strikes", "5",
            "--grpc-http2-min-recv-ping-interval-without-data", "100", "--grpc-keepalive-time", "200",
            "--grpc-keepalive-permit-without-calls", "true"]
    with geserve([good_repo], tmp_path_factory.mktemp("held") / "geserve.log", args) as running:
        yield running


# ---- HTTP helpers ---------------------------------------------------------------------------------------


def _connect(server: RunningServer, timeout: float = 5) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout)


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One Content-Length response off the socket."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {buffer!r}")
        buffer += chunk
    head, body = buffer.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    while len(body) < int(headers[b"content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def _is_open(sock: socket.socket) -> bool:
    """The server has neither answered nor closed this connection."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
    return False


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _assert_serves(server: RunningServer) -> None:
    with _connect(server) as sock:
        sock.sendall(LIVE)
        assert _read_response(sock)[0] == 200


# ---- timeouts -------------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(limited: RunningServer) -> None:
    with _connect(limited) as sock:
        data, elapsed = _read_until_closed(sock)
    assert data == b"" and EARLIEST <= elapsed <= LATEST, (data, elapsed)  # nothing was asked: nothing answered


def test_a_head_trickled_byte_by_byte_is_closed_at_the_header_timeout(limited: RunningServer) -> None:
    """Slowloris: bytes keep coming, but the head must be whole within the timeout of its first byte."""
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        for i in range(100):
            if stop.wait(0.1):
                return
            try:
                sock.sendall(b"x-slow-%d: y\r\n" % i)
            except OSError:  # the server closed the connection
                return

    with _connect(limited) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        sender = threading.Thread(target=trickle, args=(sock,))
        sender.start()
        try:
            data, elapsed = _read_until_closed(sock)
        finally:
            stop.set()
            sender.join(5)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout"), data
    assert b"--http-header-timeout-secs" in data and EARLIEST <= elapsed <= LATEST, (data, elapsed)


def test_an_idle_keep_alive_connection_is_closed_at_the_idle_timeout(limited: RunningServer) -> None:
    with _connect(limited) as sock:
        sock.sendall(LIVE)
        status, _ = _read_response(sock)
        rest, elapsed = _read_until_closed(sock)
    assert status == 200 and rest == b"" and EARLIEST <= elapsed <= LATEST, (rest, elapsed)


def test_a_connection_in_use_outlives_the_timeouts(limited: RunningServer) -> None:
    """Requests 0.6 s apart for 2.4 s: the idle clock starts again after every answer."""
    with _connect(limited) as sock:
        for _ in range(4):
            sock.sendall(LIVE)
            assert _read_response(sock)[0] == 200
            time.sleep(0.6)
        sock.sendall(LIVE)
        assert _read_response(sock)[0] == 200


def test_a_stalled_body_is_answered_408_and_closed(limited: RunningServer) -> None:
    head = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(INFER)
    with _connect(limited) as sock:
        sock.sendall(head + INFER[:10])
        data, elapsed = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408 Request Timeout"), data
    assert b"--http-body-timeout-secs" in data and EARLIEST <= elapsed <= LATEST, (data, elapsed)


def test_a_slow_body_that_keeps_moving_is_served(limited: RunningServer) -> None:
    """The body timeout is about progress: 5 pieces 0.4 s apart take longer than the timeout and are fine."""
    head = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(INFER)
    pieces = np.array_split(np.frombuffer(INFER, dtype=np.uint8), 5)
    with _connect(limited) as sock:
        sock.sendall(head)
        for piece in pieces:
            time.sleep(0.4)
            sock.sendall(piece.tobytes())
        status, body = _read_response(sock)
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2 * i for i in range(16)]


# ---- header limits --------------------------------------------------------------------------------------


def _refused_head(server: RunningServer, head: bytes) -> dict[str, str]:
    with _connect(server) as sock:
        sock.sendall(head)
        data, _ = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), data[:200]
    assert b"content-type: application/json" in data
    error: dict[str, str] = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return error


def test_headers_over_the_size_limit_are_431(limited: RunningServer) -> None:
    error = _refused_head(limited, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n" % (b"a" * 10000))
    assert "8192 bytes" in error["error"] and "--http-max-header-size" in error["error"]
    _assert_serves(limited)


def test_a_url_over_the_size_limit_is_431(limited: RunningServer) -> None:
    _refused_head(limited, b"GET /v2/health/live?%s HTTP/1.1\r\nHost: x\r\n\r\n" % (b"q" * 9000))


def test_too_many_headers_are_431(limited: RunningServer) -> None:
    fields = b"".join(b"X-Field-%d: v\r\n" % i for i in range(40))
    error = _refused_head(limited, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    assert "32 fields" in error["error"] and "--http-max-header-count" in error["error"]


def test_headers_at_the_limits_are_served(limited: RunningServer) -> None:
    fields = b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * 200) for i in range(30))  # 31 fields, ~6.6 KiB
    with _connect(limited) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert _read_response(sock)[0] == 200


def test_a_header_that_never_ends_is_cut_off(limited: RunningServer) -> None:
    """A field without its CRLF is not buffered without end: the connection is refused and closed."""
    with _connect(limited) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Endless: ")
        sent = 0
        try:
            while sent < 64 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (ConnectionResetError, BrokenPipeError):  # the server closed the connection: writing fails
            pass
        # Cut off after the limit and a read's slack (about 270 KiB here) plus what the kernel's buffers held.
        assert sent < 16 * 1024 * 1024, sent
    _assert_serves(limited)


# ---- many clients ---------------------------------------------------------------------------------------


def test_a_normal_client_is_served_while_200_slow_connections_hang(held: RunningServer) -> None:
    slow = []
    try:
        for _ in range(200):
            sock = _connect(held)
            sock.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-")  # and then nothing
            slow.append(sock)
        started = time.monotonic()
        client = httpclient.InferenceServerClient(held.url, connection_timeout=5, network_timeout=5)
        inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for item in inputs:
            item.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        result = client.infer("simple", inputs)
        elapsed = time.monotonic() - started
        client.close()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * np.arange(16).reshape(1, 16))
        assert elapsed < 2.0, elapsed
        assert all(_is_open(sock) for sock in slow)  # they were hanging all along
    finally:
        for sock in slow:
            sock.close()


def test_connections_over_the_cap_wait_in_the_backlog(held: RunningServer) -> None:
    """At --http-max-connections the server stops accepting: the next client waits, and is served (not refused)
    as soon as a connection closes."""
    idle = [_connect(held) for _ in range(HELD_CAP)]
    try:
        with _connect(held) as waiting:
            waiting.sendall(LIVE)
            waiting.settimeout(0.5)
            with pytest.raises(TimeoutError):
                waiting.recv(1)  # connected (the kernel's backlog) but not accepted
            idle.pop().close()
            waiting.settimeout(5)
            assert _read_response(waiting)[0] == 200
    finally:
        for sock in idle:
            sock.close()
    assert "--http-max-connections (250)" in held.log()
    _assert_serves(held)


def test_running_out_of_descriptors_neither_spins_nor_resets_clients(good_repo: Path, tmp_path: Path) -> None:
    """With 256 descriptors and 400 connections held open: the accept loop backs off (the process stays nearly
    idle), a connection open before the flood is still served, a new client waits instead of being reset, and
    everything is served again once the flood goes."""
    if not Path("/proc/self/stat").exists() or not hasattr(resource, "prlimit"):
        pytest.skip("needs Linux's /proc and prlimit")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:  # this test holds 400+ sockets itself
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    args = ["--http-header-timeout-secs", "30", "--http-idle-timeout-secs", "30"]
    with geserve([good_repo], tmp_path / "geserve.log", args) as server:
        pid = server.process.pid
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, 256))
        flood: list[socket.socket] = []
        with _connect(server) as keeper:
            keeper.sendall(LIVE)
            assert _read_response(keeper)[0] == 200
            try:
                for _ in range(400):
                    sock = _connect(server)
                    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
                    flood.append(sock)
                time.sleep(0.5)  # the server accepts until its descriptors run out
                before = _cpu_seconds(pid)
                time.sleep(1.0)
                busy = _cpu_seconds(pid) - before
                assert busy < 0.3, f"{busy:.2f} s of CPU in 1 s: the accept loop spins"
                assert "accepting HTTP connections paused" in server.log()
                keeper.sendall(LIVE)  # a connection the server holds is served all along
                assert _read_response(keeper)[0] == 200
                with _connect(server) as waiting:
                    waiting.sendall(LIVE)
                    waiting.settimeout(0.5)
                    with pytest.raises(TimeoutError):
                        waiting.recv(1)  # waits in the backlog: neither served nor reset
                    for sock in flood:
                        sock.close()
                    flood.clear()
                    waiting.settimeout(10)
                    assert _read_response(waiting)[0] == 200
            finally:
                for sock in flood:
                    sock.close()
        _assert_serves(server)


# ---- uvicorn and the options ----------------------------------------------------------------------------


async def _nothing(scope: object, receive: object, send: object) -> None:
    return None


def test_uvicorn_gets_what_it_supports_of_the_limits() -> None:
    limits = HttpLimits(header_timeout=5, idle_timeout=7.5, body_timeout=9, max_header_size=4096,
                        max_header_count=10, max_connections=33)
    server = create_http_server(_nothing, "127.0.0.1", 0, 0, "uvicorn", 1000, limits)
    assert not isinstance(server, NativeHttpServer)
    config = server.config
    assert (config.timeout_keep_alive, config.limit_concurrency, config.h11_max_incomplete_event_size) == (
        8, 33, 4096
    )
    native = create_http_server(_nothing, "127.0.0.1", 0, 0, "native", 1000, limits)
    assert isinstance(native, NativeHttpServer) and native.limits == limits


def test_grpc_options_become_tritons_channel_arguments() -> None:
    options = dict(GrpcOptions(
        keepalive_time_ms=1000, keepalive_timeout_ms=2000, keepalive_permit_without_calls=True,
        http2_max_pings_without_data=3, http2_min_recv_ping_interval_without_data_ms=4000,
        http2_max_ping_strikes=5, max_concurrent_streams=6,
    ).channel_options())
    assert {key: options[key] for key in (
        "grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms", "grpc.keepalive_permit_without_calls",
        "grpc.http2.max_pings_without_data", "grpc.http2.min_ping_interval_without_data_ms",
        "grpc.http2.max_ping_strikes", "grpc.max_concurrent_streams",
    )} == {
        "grpc.keepalive_time_ms": 1000, "grpc.keepalive_timeout_ms": 2000, "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 3, "grpc.http2.min_ping_interval_without_data_ms": 4000,
        "grpc.http2.max_ping_strikes": 5, "grpc.max_concurrent_streams": 6,
    }
    defaults = dict(GrpcOptions().channel_options())  # Triton's defaults
    assert defaults["grpc.keepalive_time_ms"] == 7_200_000 and defaults["grpc.http2.max_ping_strikes"] == 2


# ---- gRPC on the wire -----------------------------------------------------------------------------------
# A few raw HTTP/2 frames show what the gRPC server was configured with: its SETTINGS, its PINGs, and the
# GOAWAY "too_many_pings" that ends a connection once a client's pings earn more than the allowed strikes.

_SETTINGS, _PING, _GOAWAY = 4, 6, 7
_ACK = 1
_MAX_CONCURRENT_STREAMS = 3


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the gRPC server closed the connection")
            data += chunk
        return data

    head = exactly(9)
    length = int.from_bytes(head[:3], "big")
    return head[3], head[4], exactly(length) if length else b""


def _h2_connect(server: RunningServer) -> tuple[socket.socket, dict[int, int]]:
    """An HTTP/2 connection to the gRPC port, and the server's SETTINGS."""
    sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5)
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0))
    kind, flags, payload = _read_frame(sock)
    assert (kind, flags) == (_SETTINGS, 0)
    sock.sendall(_frame(_SETTINGS, _ACK))
    settings = dict(struct.unpack(">HI", payload[i:i + 6]) for i in range(0, len(payload), 6))
    return sock, settings


def _acked_pings_before_goaway(server: RunningServer, gap: float = 0.0, most: int = 12) -> tuple[int, bytes]:
    """Ping with no data between, `gap` seconds apart, until the server sends GOAWAY (or `most` pings)."""
    sock, _ = _h2_connect(server)
    with sock:
        acked = 0
        for n in range(most):
            time.sleep(gap)
            sock.sendall(_frame(_PING, 0, struct.pack(">Q", n)))
            while True:
                kind, flags, payload = _read_frame(sock)
                if kind == _GOAWAY:
                    return acked, payload[8:]  # last stream id, error code, then the debug text
                if kind == _PING and flags == _ACK:
                    acked += 1
                    break
                if kind == _PING:
                    sock.sendall(_frame(_PING, _ACK, payload))  # the server's keepalive ping
        return acked, b""


def test_grpc_runs_with_tritons_defaults(limited: RunningServer) -> None:
    sock, settings = _h2_connect(limited)
    sock.close()
    assert settings[_MAX_CONCURRENT_STREAMS] == 1024
    # Without a call and without --grpc-keepalive-permit-without-calls any second ping is a strike; the third
    # strike (more than --grpc-http2-max-ping-strikes 2) ends the connection.
    assert _acked_pings_before_goaway(limited) == (4, b"too_many_pings")


def test_grpc_flags_reach_the_transport(held: RunningServer) -> None:
    sock, settings = _h2_connect(held)
    with sock:
        assert settings[_MAX_CONCURRENT_STREAMS] == 3
        # --grpc-keepalive-time 200 with --grpc-keepalive-permit-without-calls: the server pings an idle
        # connection (Triton's default waits two hours, and never without a call).
        sock.settimeout(2)
        started = time.monotonic()
        while _read_frame(sock)[:2] != (_PING, 0):
            continue
        assert time.monotonic() - started < 1.5
    # --grpc-http2-max-ping-strikes 5: six strikes end the connection...
    assert _acked_pings_before_goaway(held) == (7, b"too_many_pings")
    # ... but pings further apart than --grpc-http2-min-recv-ping-interval-without-data (100 ms) earn none.
    assert _acked_pings_before_goaway(held, gap=0.15, most=8) == (8, b"")


def test_grpc_calls_beyond_the_stream_cap_wait(held: RunningServer) -> None:
    """--grpc-max-concurrent-streams 3: with three streams open on a channel, a fourth call waits."""
    release = threading.Event()

    def nothing_until_released() -> Iterator[pb.ModelInferRequest]:
        release.wait(10)
        yield from ()

    with grpc.insecure_channel(held.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live
        streams = [stub.ModelStreamInfer(nothing_until_released()) for _ in range(3)]
        try:
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as waited:
                stub.ServerLive(pb.ServerLiveRequest(), timeout=0.5)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            release.set()
            for stream in streams:
                assert list(stream) == []
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live
