"""Early batch dispatch (geserve/arrivals.py) through a real server, persistent HTTP connections and the real
tritonclient: a batch that no request can join goes before its queue delay; clients that connect together, or one that
could still send, get Triton's delay.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import models
from tests.support.server import RunningServer, geserve

DELAY_S = 1.5  # long against a request's own time on a busy 2-core machine, so "held" and "not held" cannot blur
HELD = 0.9 * DELAY_S  # a request held for the delay answers after at least this
NOT_HELD = 0.5 * DELAY_S  # one sent at once answers well before this


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("early") / "models"
    repo.mkdir()
    delay = f"max_queue_delay_microseconds: {int(DELAY_S * 1e6)}"
    models.simple(repo, "early", extra=f"dynamic_batching {{ {delay} }}")
    models.simple(repo, "plain")
    kept = models.simple(repo, "kept", extra=f"dynamic_batching {{ {delay} }}\n"
                         'parameters { key: "early_batch_dispatch" value: { string_value: "false" } }')
    config = kept / "config.pbtxt"  # on the GE backend, which refuses parameters it does not know
    config.write_text(config.read_text().replace('backend: "onnxruntime"', 'platform: "graph_executor"'))
    with geserve([repo], tmp_path_factory.mktemp("logs") / "geserve.log") as running:
        yield running


class Clients:
    """`count` persistent HTTP/1.1 connections, each sending at most one request of a round.

    Pinned connections, not tritonclient's pool: under load the pool may send two of a round's requests on one
    connection while another stays open and idle, and an idle connection may send, so the server rightly keeps the
    delay (seen: 2 of 30 runs on a loaded 2-core machine held a round of four for the delay)."""

    def __init__(self, server: RunningServer, count: int) -> None:
        self._connections = [http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
                             for _ in range(count)]
        for connection in self._connections:
            connection.connect()

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *_: object) -> None:
        for connection in self._connections:
            connection.close()

    def round(self, model: str, count: int) -> float:
        """Seconds `count` inferences sent together on the first `count` connections took to be answered."""
        started = time.monotonic()
        used = self._connections[:count]
        for value, connection in enumerate(used):
            connection.request("POST", f"/v2/models/{model}/infer", _body(value),
                               {"Content-Type": "application/json"})
        for value, connection in enumerate(used):
            response = connection.getresponse()
            answer = json.loads(response.read())
            assert response.status == 200, answer
            assert answer["outputs"][0]["data"] == [2 * value] * 16
        return time.monotonic() - started


def _body(value: int) -> bytes:
    return json.dumps({"inputs": [
        {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [value] * 16} for name in ("INPUT0", "INPUT1")
    ], "outputs": [{"name": "OUTPUT0"}]}).encode()


def _executions(server: RunningServer, model: str) -> tuple[int, int]:
    with httpclient.InferenceServerClient(server.url) as client:
        stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_clients_that_connect_together_get_the_delay_then_persistent_ones_do_not_wait(server: RunningServer) -> None:
    with Clients(server, 3) as clients:
        before = _executions(server, "early")
        assert clients.round("early", 3) >= HELD  # new connections: their peers may still be connecting
        time.sleep(DELAY_S)  # the connections are older than the delay now
        assert clients.round("early", 3) < NOT_HELD  # every client waits on an answer: nothing more can come
        after = _executions(server, "early")
    assert after[0] - before[0] == 6
    assert after[1] - before[1] <= 3  # batched all the same (one batch per round, or one round split)


def test_a_client_that_could_still_send_keeps_the_delay(server: RunningServer) -> None:
    with Clients(server, 2) as clients:
        clients.round("early", 2)
        time.sleep(DELAY_S)
        assert clients.round("early", 1) >= HELD  # the other connection is open and may send: it waits


def test_an_open_grpc_connection_keeps_the_delay(server: RunningServer) -> None:
    with Clients(server, 2) as clients:
        clients.round("early", 2)
        time.sleep(DELAY_S)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            assert grpc.is_server_live()  # connected: it may open a stream with a request at any time
            assert clients.round("early", 2) >= HELD
        finally:
            grpc.close()
        time.sleep(0.5)  # the server sees the gRPC connection close
        assert clients.round("early", 2) < NOT_HELD


def test_with_workers_each_batches_its_own_clients(tmp_path_factory: pytest.TempPathFactory) -> None:
    repo = tmp_path_factory.mktemp("early-workers") / "models"
    repo.mkdir()
    models.simple(repo, "early", extra=f"dynamic_batching {{ max_queue_delay_microseconds: {int(DELAY_S * 1e6)} }}")
    with geserve([repo], tmp_path_factory.mktemp("logs") / "workers.log", ["--workers", "2"]) as running, \
            Clients(running, 4) as clients:
        clients.round("early", 4)  # four connections, spread over the workers
        time.sleep(DELAY_S)
        assert clients.round("early", 4) < NOT_HELD


def test_the_model_parameter_turns_it_off(server: RunningServer) -> None:
    with Clients(server, 2) as clients:
        clients.round("kept", 2)
        time.sleep(DELAY_S)
        assert clients.round("kept", 2) >= HELD


def _post(path: str, body: bytes) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_unusual_connections_leave_the_counts_whole(server: RunningServer) -> None:
    """Pipelined requests, a client gone with its request queued, a malformed request, a connection that never sends:
    once they are closed, persistent clients still see their batches go at once (a count left off either way would
    keep the batcher waiting)."""
    body = _body(1)
    address = ("127.0.0.1", server.http_port)
    with socket.create_connection(address, timeout=10) as pipelined:
        pipelined.sendall(_post("/v2/models/plain/infer", body) * 3)
        received = b""
        while received.count(b"HTTP/1.1 200") < 3:
            received += pipelined.recv(65536)
    with socket.create_connection(address, timeout=10) as gone:
        gone.sendall(_post("/v2/models/early/infer", body))  # queued for the delay: a new connection's peers may come
        time.sleep(0.2)
    with socket.create_connection(address, timeout=10) as malformed:
        malformed.sendall(b"NOT HTTP\r\n\r\n")
        assert malformed.recv(4096).startswith(b"HTTP/1.1 400")
    socket.create_connection(address, timeout=10).close()
    time.sleep(DELAY_S)  # the client gone has been answered to nobody; the connections above are all closed
    with Clients(server, 2) as clients:
        clients.round("early", 2)
        time.sleep(DELAY_S)
        assert clients.round("early", 2) < NOT_HELD


def test_an_invalid_parameter_fails_the_load(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "bad", extra="dynamic_batching { }\n"
                  'parameters { key: "early_batch_dispatch" value: { string_value: "soon" } }')
    with geserve([repo], tmp_path / "log") as running, httpclient.InferenceServerClient(running.url) as client:
        assert not client.is_model_ready("bad")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert "early_batch_dispatch" in index["bad"]["reason"]
