"""The least Python a KServe v2 binary inference can cost: a reference server that bounds what any Python front door
could reach on this machine, for workers_bench's `lean` section (issue 15's batched cell).

It serves one ONNX model the way perf_analyzer asks for it and nothing more: httptools parsing, the JSON header
decoded once per distinct header, a batch joined by one numpy concatenate and run on the event loop, each response
written in one write. With a queue delay it batches as geserve's early dispatch does: at once when every open
connection of the process waits on an answer, else after the delay. No validation, no statistics but counts, no
error handling for bad input: it is a yardstick, not a server. `--workers N` forks N processes on one SO_REUSEPORT
port; their counts live in one shared array so /v2/models/NAME/stats answers for all of them.

Usage: .venv/bin/python bench/lean_server.py MODEL.onnx --name mlp --port 18100 [--workers 2]
       [--max-queue-delay-us 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
from typing import Any

import httptools
import numpy as np
import onnxruntime as ort
import uvloop

_WIRE = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(int64)": "INT64", "tensor(int32)": "INT32"}
_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


class Model:
    """One ONNX Runtime session (one thread, no spinning: geserve's setting with a worker per core) and its
    metadata, config and per-process counts."""

    def __init__(self, path: str, name: str, delay_us: int, counts: Any, slot: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.run = session._sess.run  # the native run, as geserve's GE backend calls it
        self.name, self.delay_s, self.counts, self.slot = name, delay_us / 1e6, counts, slot
        inputs = [(i.name, _WIRE[i.type], i.shape[1:]) for i in session.get_inputs()]
        outputs = [(o.name, _WIRE[o.type], o.shape[1:]) for o in session.get_outputs()]
        self.outputs = [name for name, _, _ in outputs]
        self.output_types = [wire for _, wire, _ in outputs]
        self.metadata = json.dumps({
            "name": name, "versions": ["1"], "platform": "onnxruntime_onnx",
            "inputs": [{"name": n, "datatype": t, "shape": [-1, *s]} for n, t, s in inputs],
            "outputs": [{"name": n, "datatype": t, "shape": [-1, *s]} for n, t, s in outputs],
        }).encode()
        self.config = json.dumps({
            "name": name, "platform": "onnxruntime_onnx", "max_batch_size": 256,
            "input": [{"name": n, "data_type": "TYPE_" + t, "dims": s} for n, t, s in inputs],
            "output": [{"name": n, "data_type": "TYPE_" + t, "dims": s} for n, t, s in outputs],
            **({"dynamic_batching": {"max_queue_delay_microseconds": delay_us}} if delay_us else {}),
        }).encode()
        self.plans: dict[bytes, list[tuple[str, Any, tuple[int, ...], int]]] = {}
        self.pending: list[tuple[Connection, dict[str, np.ndarray]]] = []
        self.connections = 0
        self.timer: asyncio.TimerHandle | None = None

    def stats(self) -> bytes:
        inferences, executions = sum(self.counts[0::2]), sum(self.counts[1::2])
        done = {"count": inferences, "ns": 0}
        return json.dumps({"model_stats": [{
            "name": self.name, "version": "1", "last_inference": 0, "inference_count": inferences,
            "execution_count": executions,
            "inference_stats": {k: done for k in ("success", "queue", "compute_input", "compute_infer",
                                                  "compute_output")} | {"fail": {"count": 0, "ns": 0}},
            "batch_stats": [],
        }]}).encode()

    def feed(self, header: bytes, body: bytes) -> dict[str, np.ndarray]:
        plan = self.plans.get(header)
        if plan is None:
            plan = self.plans[header] = [
                (i["name"], _NUMPY[i["datatype"]], tuple(i["shape"]), i["parameters"]["binary_data_size"])
                for i in json.loads(header)["inputs"]
            ]
        arrays, offset = {}, len(header)
        for name, dtype, shape, size in plan:
            arrays[name] = np.frombuffer(body, dtype, offset=offset, count=size // np.dtype(dtype).itemsize
                                         ).reshape(shape)
            offset += size
        return arrays

    def submit(self, connection: Connection, arrays: dict[str, np.ndarray]) -> None:
        self.pending.append((connection, arrays))
        if not self.delay_s or len(self.pending) >= self.connections:
            self.run_batch()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.delay_s, self.run_batch)

    def run_batch(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if not batch:
            return
        names = batch[0][1].keys()
        feed = {n: np.concatenate([a[n] for _, a in batch]) if len(batch) > 1 else batch[0][1][n] for n in names}
        results = self.run(self.outputs, feed, None)
        self.counts[2 * self.slot] += len(batch)
        self.counts[2 * self.slot + 1] += 1
        row = 0
        for connection, arrays in batch:
            rows = next(iter(arrays.values())).shape[0]
            parts = [r[row:row + rows] for r in results]
            row += rows
            outputs = [{"name": n, "datatype": t, "shape": list(p.shape), "parameters": {"binary_data_size": p.nbytes}}
                       for n, t, p in zip(self.outputs, self.output_types, parts, strict=True)]
            header = json.dumps({"model_name": self.name, "model_version": "1", "outputs": outputs},
                                separators=(",", ":")).encode()
            connection.answer(b"application/octet-stream", header + b"".join(p.tobytes() for p in parts),
                              b"inference-header-content-length: %d\r\n" % len(header))


class Connection(asyncio.Protocol):
    def __init__(self, model: Model) -> None:
        self.model = model
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.header_size = 0
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.model.connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.model.connections -= 1

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.header_size, self.body = b"", 0, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.header_size = int(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        model, url = self.model, self.url
        if url.endswith(b"/infer"):
            body = b"".join(self.body)
            model.submit(self, model.feed(body[:self.header_size], body))
        elif url.endswith(b"/config"):
            self.answer(b"application/json", model.config)
        elif url.endswith(b"/stats"):
            self.answer(b"application/json", model.stats())
        elif url.startswith(b"/v2/health"):
            self.answer(b"text/plain", b"")
        else:
            self.answer(b"application/json", model.metadata)

    def answer(self, content_type: bytes, body: bytes, extra: bytes = b"") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
                                 % (content_type, len(body), extra, body))


async def serve(args: argparse.Namespace, counts: Any, slot: int) -> None:
    model = Model(args.model, args.name, args.max_queue_delay_us, counts, slot)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(1024)
    server = await asyncio.get_running_loop().create_server(lambda: Connection(model), sock=listener)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-queue-delay-us", type=int, default=0)
    args = parser.parse_args()
    counts = multiprocessing.RawArray("q", 2 * args.workers)  # inferences, executions per process
    slot = 0  # the parent's: it is the root of the process tree the bench measures
    for child in range(1, args.workers):
        if os.fork() == 0:
            slot = child
            break
    uvloop.run(serve(args, counts, slot))


if __name__ == "__main__":
    main()
