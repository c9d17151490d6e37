"""The one request path's shortcuts on HTTP (InferenceService.submit, HttpFrontend.begin): a remembered header (the
decode and prepare steps memoized by its bytes, codec.remember_prepared), a request queued with a callback or run at
once on the loop instead of in a task, and the connection's replayed head. Each must answer exactly what the path
without it answers, keep the answers of a connection in order, count statistics alike, and withdraw a queued request
whose client went away (CANCELED).

The first tests feed perf_analyzer's kind of request bytes to the native HTTP server's connection objects in-process
(a real server's models and ONNX Runtime sessions, a transport that keeps what is written), so they can see which
step served each request; the last drives a real server process with tritonclient, binary and JSON requests at once.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

from geserve import Server, ServerSettings
from geserve.frontends.http import codec
from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.connection import HttpConnection, Turn
from geserve.frontends.http.native_server import NativeHttpServer
from tests.support import models
from tests.support.server import geserve

LIMIT = 64 << 20
QUEUED = "dynamic_batching { max_queue_delay_microseconds: 20000 }"
HELD = 'dynamic_batching { max_queue_delay_microseconds: 30000000 }\nparameters { key: "early_batch_dispatch" ' \
       'value: { string_value: "false" } }'


class KeepingTransport(asyncio.Transport):
    """Stands in for a client's socket: keeps what the server writes, and whether it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def request_bytes(model: str, value: int, *, binary_outputs: bool = True, reverse: bool = True) -> bytes:
    """A tritonclient request for `simple`: both inputs binary, INPUT1 first (so the lane reorders them)."""
    tensors = []
    for name, data in (("INPUT0", value), ("INPUT1", 1)):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.full((1, 16), data, np.int32), binary_data=True)
        tensors.append(tensor)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary_outputs) for n in ("OUTPUT0", "OUTPUT1")]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        tensors[::-1] if reverse else tensors, outputs=outputs
    )
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {json_size}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def json_request_bytes(model: str, value: int) -> bytes:
    body = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [v] * 16}
                                  for n, v in (("INPUT0", value), ("INPUT1", 1))]}).encode()
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def split_responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each HTTP response in `data`, in order."""
    answers = []
    while data:
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
        answers.append((head, rest[:length]))
        data = rest[length:]
    return answers


def outputs_of(answer: tuple[bytes, bytes]) -> dict[str, list[int]]:
    head, body = answer
    assert head.startswith(b"HTTP/1.1 200"), head
    sizes = [line for line in head.split(b"\r\n") if line.lower().startswith(b"inference-header-content-length")]
    header_length = int(sizes[0].split(b":")[1]) if sizes else len(body)
    header = json.loads(body[:header_length])
    values, offset = {}, header_length
    for output in header["outputs"]:
        if "data" in output:
            values[output["name"]] = output["data"]
        else:
            size = output["parameters"]["binary_data_size"]
            values[output["name"]] = np.frombuffer(body, np.int32, size // 4, offset).tolist()
            offset += size
    return values


def in_process(tmp_path: Path, body: Callable[[Server, HttpFrontend, NativeHttpServer], Awaitable[None]]) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "queued", extra=QUEUED)
    models.simple(repo, "held", extra=HELD)
    models.simple(repo, "unbatched")

    async def main() -> None:
        server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False, model_control_mode="explicit", load_models=["*"]))
        await server.start()
        frontend = HttpFrontend(server.service, LIMIT)
        try:
            await body(server, frontend, NativeHttpServer(frontend, "127.0.0.1", 0, LIMIT))
        finally:
            await server.stop()

    asyncio.run(main())


def connect(http: NativeHttpServer) -> tuple[HttpConnection, KeepingTransport]:
    connection, transport = HttpConnection(http), KeepingTransport()
    connection.connection_made(transport)
    return connection, transport


async def answers(transport: KeepingTransport, count: int) -> list[tuple[bytes, bytes]]:
    for _ in range(500):
        if transport.written.count(b"HTTP/1.1 ") >= count:
            break
        await asyncio.sleep(0.01)
    return split_responses(transport.written.removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n"))


def remembered(data: bytes) -> Any:
    """What the prepare step made of the request in `data`, as its header's memo keeps it (None: nothing)."""
    header_length = int(data.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
    known = codec._known_headers.get(data.split(b"\r\n\r\n", 1)[1][:header_length])
    return None if known is None else known.prepared


def stats(server: Server, model: str) -> dict[str, Any]:
    return server.service._statistics(model, "")["model_stats"][0]


def test_a_remembered_header_answers_byte_for_byte_what_a_full_prepare_answered(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        for binary in (True, False):
            connection, transport = connect(http)
            data = request_bytes("queued", 5, binary_outputs=binary)
            connection.data_received(data)  # prepared in full: its header is remembered with what prepare made
            assert connection._responder.turn is Turn.APP  # queued with a callback: no task
            (first,) = await answers(transport, 1)
            assert remembered(data).model is server.service._manager.get("queued")
            transport.written = b""
            queued = server.service.paths["queued"]
            connection.data_received(data)
            assert connection._responder.turn is Turn.APP and server.service.paths["queued"] == queued + 1
            (second,) = await answers(transport, 1)
            assert second == first
            assert outputs_of(second) == {"OUTPUT0": [6] * 16, "OUTPUT1": [4] * 16}
        recorded = stats(server, "queued")
        assert recorded["inference_count"] == recorded["inference_stats"]["success"]["count"] == 4
        assert recorded["inference_stats"]["queue"]["count"] == 4

    in_process(tmp_path, body)


def test_a_model_that_runs_at_once_is_answered_without_awaiting(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        connection, transport = connect(http)
        data = request_bytes("unbatched", 5)
        tasks = server.service.paths["task"]
        connection.data_received(data)  # in a task: the pool has not timed the model yet
        (first,) = await answers(transport, 1)
        assert server.service.paths["task"] == tasks + 1 and remembered(data) is not None
        # A short model runs on the loop once the pool has timed it short; its cold first run may not have been.
        server.service._manager.get("unbatched").scheduler._pool._typical_ns = 1
        for _ in range(2):
            transport.written = b""
            inline = server.service.paths["inline"]
            connection.data_received(data)
            assert split_responses(transport.written) == [first]  # answered within the call: nothing awaited
            assert server.service.paths["inline"] == inline + 1
        recorded = stats(server, "unbatched")
        assert recorded["inference_count"] == recorded["execution_count"] == 3
        assert recorded["inference_stats"]["success"]["count"] == 3

    in_process(tmp_path, body)


def test_pipelined_requests_are_answered_in_order_whichever_step_serves_them(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        connection, transport = connect(http)
        connection.data_received(request_bytes("queued", 1))
        await answers(transport, 1)
        transport.written = b""
        # The first is queued from the read; the JSON one and the next ones wait their turn behind it (a task).
        connection.data_received(request_bytes("queued", 2) + json_request_bytes("queued", 3)
                                 + request_bytes("queued", 4) + request_bytes("unbatched", 5))
        got = await answers(transport, 4)
        assert [outputs_of(a)["OUTPUT0"][0] for a in got] == [3, 4, 5, 6]
        assert stats(server, "queued")["inference_count"] == 4

    in_process(tmp_path, body)


def test_a_client_that_goes_away_withdraws_its_queued_request(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        data = request_bytes("held", 7)
        connection, transport = connect(http)
        connection.data_received(data)
        assert connection._responder.turn is Turn.APP
        scheduler = server.service._manager.get("held").scheduler
        assert scheduler.inflight_count == 1
        connection.connection_lost(None)
        await asyncio.sleep(0.05)
        assert scheduler.inflight_count == 0 and transport.written == b""
        recorded = stats(server, "held")
        assert recorded["inference_stats"]["fail"]["count"] == 1 and recorded["execution_count"] == 0
        assert http.inflight == 0 and server.service.inflight == 0

    in_process(tmp_path, body)


def test_a_reloaded_model_prepares_again(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        connection, transport = connect(http)
        data = request_bytes("queued", 2)
        for _ in range(2):
            connection.data_received(data)
            await answers(transport, 1)
            transport.written = b""
        plan = remembered(data)
        await server.service.unload_model("queued")
        connection.data_received(data)
        (gone,) = await answers(transport, 1)
        assert gone[0].startswith(b"HTTP/1.1 404") or gone[0].startswith(b"HTTP/1.1 400"), gone
        assert connection._responder.turn is not Turn.APP
        transport.written = b""
        await server.service.load_model("queued", {})
        connection.data_received(data)  # prepared in full again: the memo held the unloaded model
        (back,) = await answers(transport, 1)
        assert outputs_of(back)["OUTPUT0"] == [3] * 16
        assert remembered(data).model is not plan.model
        assert remembered(data).model is server.service._manager.get("queued")

    in_process(tmp_path, body)


class CountingParser:
    """httptools' parser, counting the reads it is fed (the connection's replay feeds it none)."""

    def __init__(self, parser: Any) -> None:
        self._parser = parser
        self.fed = 0

    def feed_data(self, data: bytes) -> None:
        self.fed += 1
        self._parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def test_a_repeated_head_is_answered_without_parsing_it_again(tmp_path: Path) -> None:
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        server.service._manager.get("unbatched").scheduler._pool._typical_ns = 1  # runs on the loop: answered now
        for model, split in (("queued", False), ("unbatched", False), ("queued", True), ("unbatched", True)):
            connection, transport = connect(http)
            parser = connection._parser = CountingParser(connection._parser)
            for value in range(6):  # parsed, then replayed once the head is learnt
                data = request_bytes(model, value)
                if split:  # as libcurl sends it: the head, then the body (here in two reads)
                    cut = data.index(b"\r\n\r\n") + 4
                    for start, end in ((0, cut), (cut, cut + 100), (cut + 100, len(data))):
                        connection.data_received(data[start:end])
                else:
                    connection.data_received(data)
                (answer,) = await answers(transport, 1)
                transport.written = b""
                assert outputs_of(answer) == {"OUTPUT0": [value + 1] * 16, "OUTPUT1": [value - 1] * 16}
            assert connection._replay is not None and connection._replay.learnt and parser.fed < (18 if split else 6)
            # Two requests in one read are parsed (and answered in order), as is a body of another length.
            fed = parser.fed
            connection.data_received(request_bytes(model, 7) + request_bytes(model, 8))
            assert [outputs_of(a)["OUTPUT0"][0] for a in await answers(transport, 2)] == [8, 9]
            transport.written = b""
            data = request_bytes(model, 10)  # a held head whose body comes with the next request
            cut = data.index(b"\r\n\r\n") + 4
            connection.data_received(data[:cut])
            connection.data_received(data[cut:] + request_bytes(model, 11))
            assert [outputs_of(a)["OUTPUT0"][0] for a in await answers(transport, 2)] == [11, 12]
            transport.written = b""
            connection.data_received(request_bytes(model, 9, binary_outputs=False))
            assert outputs_of((await answers(transport, 1))[0])["OUTPUT0"] == [10] * 16
            assert parser.fed == fed + 3
        assert stats(server, "queued")["inference_count"] == 22

    in_process(tmp_path, body)


def test_a_head_is_not_replayed_when_it_asks_for_more_than_its_bytes(tmp_path: Path) -> None:
    """`Expect: 100-continue` (the server answers before the body) and a chunked body (the bytes read are not the
    body) are parsed every time; a model unloaded under a replayed head is answered as any unknown model."""
    async def body(server: Server, frontend: HttpFrontend, http: NativeHttpServer) -> None:
        data = request_bytes("queued", 1)
        head, payload = data.split(b"\r\n\r\n", 1)
        chunked = head.replace(b"Content-Length: %d" % len(payload), b"Transfer-Encoding: chunked")
        kinds = {
            b"expect": head + b"\r\nExpect: 100-continue\r\n\r\n" + payload,
            b"chunked": chunked + b"\r\n\r\n" + b"%x\r\n" % len(payload) + payload + b"\r\n0\r\n\r\n",
        }
        for kind, data in kinds.items():
            connection, transport = connect(http)
            for _ in range(4):
                connection.data_received(data)
                (got,) = await answers(transport, 2 if kind == b"expect" else 1)  # after `100 Continue`
                assert outputs_of(got)["OUTPUT0"] == [2] * 16, kind
                assert transport.written.startswith(b"HTTP/1.1 100 Continue") is (kind == b"expect")
                transport.written = b""
            assert connection._replay is not None and not connection._replay.learnt, kind
        connection, transport = connect(http)
        for _ in range(3):
            connection.data_received(data := request_bytes("queued", 1))
            await answers(transport, 1)
            transport.written = b""
        assert connection._replay is not None and connection._replay.learnt
        await server.service.unload_model("queued")
        connection.data_received(data)
        (gone,) = await answers(transport, 1)
        assert gone[0].startswith(b"HTTP/1.1 404"), gone

    in_process(tmp_path, body)


def test_a_real_server_batches_remembered_and_json_requests_alike(tmp_path: Path) -> None:
    """tritonclient's binary requests (remembered headers, once known) and JSON ones at once, on a real server:
    every answer right, every request counted, and they share batches."""
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "batched", extra="dynamic_batching { max_queue_delay_microseconds: 5000 }")
    with geserve([repo], tmp_path / "geserve.log") as server:

        def client(first: int) -> list[list[int]]:  # one of eight clients, each with a request in flight at a time
            connection = httpclient.InferenceServerClient(server.url)
            got = []
            for value in range(first, first + 30):
                inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
                binary = value % 3 != 0
                inputs[0].set_data_from_numpy(np.full((1, 16), value, np.int32), binary_data=binary)
                inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32), binary_data=binary)
                got.append(connection.infer("batched", inputs).as_numpy("OUTPUT0")[0].tolist())
            connection.close()
            return got

        with ThreadPoolExecutor(8) as pool:
            got = [answer for answers in pool.map(client, range(0, 240, 30)) for answer in answers]
        assert got == [[v + 1] * 16 for v in range(240)]
        with urllib.request.urlopen(f"{server.base}/v2/models/batched/stats", timeout=10) as response:
            recorded = json.loads(response.read())["model_stats"][0]
        assert recorded["inference_count"] == recorded["inference_stats"]["success"]["count"] == 240
        assert recorded["execution_count"] < 240  # batched
