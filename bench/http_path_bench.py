"""The CPU one HTTP inference costs geserve's event-loop thread, with the kernel and the client taken out: the MLP
served in-process (its own ONNX Runtime session, as configured), requests fed to the native HTTP server's connection
objects as perf_analyzer's bytes, answers caught by a stand-in transport. Layers are peeled one at a time:

- http: the whole path (HTTP parsing, the inference app, decoding, the service, scheduling, ONNX Runtime, encoding);
- service: `service.infer` on a decoded request (the service, scheduling and ONNX Runtime);
- onnxruntime: the model's session run alone (b=1);
- refused: a request admission control refuses (503), the model held at its concurrency limit (the service's count
  of held requests set to the limit: nothing runs);

each unbatched (one connection, one request at a time) and with `dynamic_batching { max_queue_delay_microseconds:
2000 }` (16 connections, each with one request in flight, as perf_analyzer's c=16 closed loop; issue 15's cell), as
the main thread's CPU per request (time.thread_time, so ONNX Runtime's pool threads are left out) in alternating
rounds. It shows where a request's CPU goes; on this VM a cell still moves by about 10% between runs, so A/B small
changes over several runs of each tree. Writes bench/results/http_path.md.

Usage: .venv/bin/python bench/http_path_bench.py [--rounds N] [--requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
from report_table import median_rows  # noqa: E402

from geserve import InferenceRequest, InputTensor, Server, ServerSettings  # noqa: E402
from geserve.devices.target import share_cores  # noqa: E402
from geserve.frontends.http.app import HttpFrontend  # noqa: E402
from geserve.frontends.http.native_server import NativeHttpServer, _Connection  # noqa: E402
from geserve.workers.supervisor import worker_count  # noqa: E402

MODEL = "mlp"
CONCURRENCY = 16  # connections with one request each in the batched cells
DELAY_US = 2000  # the batched cells' max_queue_delay_microseconds
ADMITTED_SUFFIX = "_admitted"  # the batched model again, with admission control (the refusal cell's)


class CatchingTransport(asyncio.Transport):
    """Stands in for a socket: keeps nothing, counts the responses written and wakes whoever waits for them."""

    def __init__(self, done: Callable[[], None]) -> None:
        super().__init__()
        self._done = done

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._done()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def request_bytes(model: str) -> bytes:
    """What perf_analyzer sends for one MLP inference (binary input, outputs as it asks for them)."""
    tensor = httpclient.InferInput("input", [1, 256], "FP32")
    tensor.set_data_from_numpy(np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32))
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [tensor], outputs=[httpclient.InferRequestedOutput("logits", binary_data=True)]
    )
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost:8000\r\nAccept: */*\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {json_size}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def http_cost(front: NativeHttpServer, model: str, connections: int, requests: int) -> float:
    """Main-thread CPU µs per request through the HTTP server, `connections` clients each keeping one in flight."""
    loop = asyncio.get_running_loop()
    data = request_bytes(model)
    waiting: asyncio.Future[None] = loop.create_future()
    answered = 0

    def done() -> None:
        nonlocal answered
        answered += 1
        if not waiting.done():
            waiting.set_result(None)

    conns = []
    for _ in range(connections):
        conn = _Connection(front)
        conn.connection_made(CatchingTransport(done))
        conns.append(conn)

    async def rounds(count: int) -> None:
        nonlocal waiting, answered
        for _ in range(count // connections):
            answered = 0
            for conn in conns:
                conn.data_received(data)
            while answered < connections:
                waiting = loop.create_future()
                await waiting

    await rounds(200 * connections)  # warm: the pool's inline decision settles, caches fill
    started = time.thread_time()
    await rounds(requests)
    cost = (time.thread_time() - started) / requests * 1e6
    for conn in conns:
        conn.connection_lost(None)
    return cost


async def refusal_cost(server: Server, front: NativeHttpServer, model: str, requests: int) -> float:
    """Main-thread CPU µs per request refused at `model`'s concurrency limit, through the HTTP server."""
    admission = server.manager.get(model, "").admission
    assert admission is not None, "the model's overload_control parameter turns it on"
    admission.held = int(admission.limit)
    try:
        return await http_cost(front, model, 1, requests)
    finally:
        admission.held = 0


async def service_cost(server: Server, model: str, connections: int, requests: int) -> float:
    feed = np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32)

    def one() -> InferenceRequest:
        return InferenceRequest(model, "", [InputTensor("input", "FP32", (1, 256), feed)])

    async def rounds(count: int) -> None:
        for _ in range(count // connections):
            await asyncio.gather(*(server.service.infer(one()) for _ in range(connections)))

    await rounds(200 * connections)
    started = time.thread_time()
    await rounds(requests)
    return (time.thread_time() - started) / requests * 1e6


def onnxruntime_cost(requests: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(harness.EXAMPLES / MODEL / "1" / "model.onnx"), options)
    feed = {"input": np.random.default_rng(0).standard_normal((1, 256), dtype=np.float32)}
    for _ in range(200):
        session.run(None, feed)
    started = time.thread_time()
    for _ in range(requests):
        session.run(None, feed)
    return (time.thread_time() - started) / requests * 1e6


async def measure(repo: Path, rounds: int, requests: int) -> dict[str, list[float]]:
    share_cores(worker_count(0))  # the sessions' threads as one of `--workers` auto's processes sets them
    server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                   allow_metrics=False))
    await server.start()
    front = NativeHttpServer(HttpFrontend(server.service, 64 << 20), "127.0.0.1", 0, 64 << 20)
    cells: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for label, cost in (
                ("http, unbatched", http_cost(front, MODEL, 1, requests)),
                ("service, unbatched", service_cost(server, MODEL, 1, requests)),
                (f"http, dynamic batching, {CONCURRENCY} connections",
                 http_cost(front, MODEL + harness.DB_SUFFIX, CONCURRENCY, requests)),
                (f"service, dynamic batching, {CONCURRENCY} at once",
                 service_cost(server, MODEL + harness.DB_SUFFIX, CONCURRENCY, requests)),
                ("http, refused at the concurrency limit (503)",
                 refusal_cost(server, front, MODEL + ADMITTED_SUFFIX, requests)),
            ):
                cells.setdefault(label, []).append(await cost)
            cells.setdefault("onnxruntime session run, b=1, 1 thread", []).append(onnxruntime_cost(requests))
    finally:
        await server.stop()
    return cells


def report(cells: dict[str, list[float]], rounds: int, requests: int) -> str:
    lines = [
        "# One HTTP inference's CPU on geserve's event-loop thread (MLP, in-process, no kernel)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {rounds} rounds of {requests} requests per cell, medians; "
        "`.venv/bin/python bench/http_path_bench.py`",
        "",
        *median_rows("cell", "main-thread CPU µs per request", cells, 1),
    ]
    return "\n".join(lines) + "\n"


def admitted_repository(repo: Path) -> None:
    """The batched model again under MODEL + ADMITTED_SUFFIX, admission-controlled by its `overload_control`
    parameter (the other cells' models keep the server's default: off)."""
    batched = repo / (MODEL + harness.DB_SUFFIX)
    admitted = repo / (MODEL + ADMITTED_SUFFIX)
    shutil.copytree(batched, admitted, symlinks=True)
    config = (batched / "config.pbtxt").read_text().replace(MODEL + harness.DB_SUFFIX, MODEL + ADMITTED_SUFFIX)
    (admitted / "config.pbtxt").write_text(
        config + '\nparameters { key: "overload_control" value: { string_value: "on" } }\n')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8000)
    args = parser.parse_args()
    harness.ensure_installed([MODEL])
    with tempfile.TemporaryDirectory(prefix="http-path-") as tmp:
        repo = harness.model_repository([MODEL], Path(tmp) / "repo", DELAY_US)
        admitted_repository(repo)
        try:
            import uvloop

            cells = uvloop.run(measure(repo, args.rounds, args.requests))
        except ImportError:
            cells = asyncio.run(measure(repo, args.rounds, args.requests))
    text = report(cells, args.rounds, args.requests)
    print(text)
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    (harness.RESULTS / "http_path.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
