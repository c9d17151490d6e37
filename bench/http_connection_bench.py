"""The Python the native HTTP server's connection spends per request, in-process: the same request bytes fed again
and again to connection objects (`_Connection` with a stand-in transport that counts the answers), served by a real
`Server` with tests/support/models.py's `simple` (INT32 [16] add / sub, ONNX Runtime), no kernel and no client.

Cells (each `--requests` requests, ten times as many for a stub's; CPU µs of the event-loop thread per request,
time.thread_time):

- replayed: one connection, `simple` unbatched and run on the loop (its pool's `_typical_ns` set to 1), so each read
  is answered within data_received; the connection replays the repeated head (no httptools);
- parsed: the same with the replay off (`NativeHttpServer.replay = False`): httptools parses every request;
- batched: `CONNECTIONS` connections with one request each in flight, to `simple` with dynamic batching, answered
  through DirectApp.begin's callback; heads replayed;
- pipelined: one connection sending two requests per read to `simple` with dynamic batching and no queue delay: the
  first is answered through the callback, the second waits behind it and is answered by the connection's task;
- stub ...: the same four paths with a stub DirectApp that answers every request with the same bytes (at once, or from
  the loop's next turn): no service and no model, the connection's own Python alone.

With `--baseline FILE|REF`, a second native_server module (a file, or geserve/frontends/http/native_server.py at a git
revision) is loaded beside the working tree's and each cell runs on both, on the same server and models: in `SLICES`
slices that the two take turns at (the machine is shared: a change in its load falls on both), each slice on new
connections. The table shows each cell's median over the rounds, and every round. The baseline module is loaded alone:
its own imports come from the working tree, so it must be one that holds its connection class (as native_server.py did
before connection.py, replay.py and messages.py were split from it, e.g. commit c53bc5a).

Usage: .venv/bin/python bench/http_connection_bench.py [--rounds N] [--requests N] [--baseline FILE|REF]
       [--cells replayed,parsed,batched,pipelined,stub replayed,stub parsed,stub later,stub pipelined]
Writes bench/results/http_connection.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402

from geserve import Server, ServerSettings  # noqa: E402
from geserve.arrivals import ARRIVALS  # noqa: E402
from geserve.frontends.http import native_server  # noqa: E402
from geserve.frontends.http.app import HttpFrontend  # noqa: E402
from tests.support import models  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LIMIT = 64 << 20
CONNECTIONS = 8  # the batched cell's clients, each with one request in flight
BATCHED = "dynamic_batching { max_queue_delay_microseconds: 200 }"
QUEUED = "dynamic_batching { max_queue_delay_microseconds: 0 }"  # the pipelined cell's: no wait for a batch
SOURCE = "geserve/frontends/http/native_server.py"
SLICES = 6  # each cell's requests, in slices the trees take turns at
WARM = 240  # requests each slice's connections send before it is timed (the replay learns, the memos fill)


class CountingTransport:
    """Stands in for a client's socket: counts the responses written (one write each), keeps none of them."""

    def __init__(self) -> None:
        self.answers = 0
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    def write(self, data: bytes) -> None:
        self.answers += 1
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

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


def request_bytes(model: str, value: int) -> bytes:
    """tritonclient's request for `simple`: both inputs binary, both outputs asked for binary."""
    tensors = []
    for name, data in (("INPUT0", value), ("INPUT1", 1)):
        tensor = httpclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.full((1, 16), data, np.int32), binary_data=True)
        tensors.append(tensor)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(tensors, outputs=outputs)
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost:8000\r\nContent-Type: application/octet-stream"
            f"\r\nInference-Header-Content-Length: {json_size}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _drive(http: Any, module: ModuleType, connections: int, data: bytes, answers_per_read: int,
                 requests: int) -> float:
    """CPU seconds for `requests` requests: each connection sends `data` and waits for its answers. The connections
    are made for the call, warmed (the replay learns the head) and lost after it, so that the idle clients counted in
    ARRIVALS are this call's alone."""
    pairs = []
    for _ in range(connections):
        transport = CountingTransport()
        connection = module._Connection(http)
        connection.connection_made(transport)
        pairs.append((connection, transport))
    loop = asyncio.get_running_loop()

    async def rounds(count: int) -> None:
        for _ in range(count // (connections * answers_per_read)):
            for connection, transport in pairs:
                transport.answers = 0
                connection.data_received(data)
            for _, transport in pairs:
                while transport.answers < answers_per_read:
                    transport.waiter = loop.create_future()
                    await transport.waiter

    await rounds(WARM)
    started = time.thread_time()
    await rounds(requests)
    spent = time.thread_time() - started
    for connection, _ in pairs:
        connection.connection_lost(None)
    return spent


class StubApp:
    """A DirectApp that answers every request with the same bytes, at once or from the loop's next turn: what is left
    is the connection's own Python (parsing or replaying, direct answering, writing)."""

    shortcuts = True

    def __init__(self, later: bool) -> None:
        self._later = later
        self._answer = (200, b'{"outputs":[]}', b"application/json", [(b"inference-header-content-length", b"14")],
                        None)

    async def respond(self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
                      client: tuple[str, int] | None, extensions: dict[str, Any] | None) -> Any:
        return self._answer

    def begin(self, method: str, path: str, headers: dict[bytes, bytes], source: bytes,
              client: tuple[str, int] | None, extensions: dict[str, Any] | None, deliver: Any) -> Any:
        if not self._later:
            return self._answer
        asyncio.get_running_loop().call_soon(deliver, self._answer)
        return _withdraw


def _withdraw() -> None:
    pass


# name: (what it measures, app ("model" or a stub answering "now" / "later"), model, connections, requests per read,
# replay on, share of --requests)
CELLS: dict[str, tuple[str, str, str, int, int, bool, int]] = {
    "replayed": ("simple, 1 connection, head replayed, answered in the read", "model", "simple", 1, 1, True, 1),
    "parsed": ("simple, 1 connection, parsed (replay off), answered in the read", "model", "simple", 1, 1, False, 1),
    "batched": (f"dynamic batching, {CONNECTIONS} connections, head replayed, answered by callback", "model",
                "batched", CONNECTIONS, 1, True, 1),
    "pipelined": ("dynamic batching (no delay), 1 connection, 2 requests per read (the second by the task)", "model",
                  "queued", 1, 2, True, 1),
    "stub replayed": ("stub app, head replayed, answered in the read", "now", "simple", 1, 1, True, 10),
    "stub parsed": ("stub app, parsed (replay off), answered in the read", "now", "simple", 1, 1, False, 10),
    "stub later": (f"stub app, {CONNECTIONS} connections, head replayed, answered by callback", "later", "simple",
                   CONNECTIONS, 1, True, 10),
    "stub pipelined": ("stub app answering by callback, 2 requests per read (the second by the task)", "later",
                       "simple", 1, 2, True, 10),
}


async def cell(trees: list[tuple[str, ModuleType]], frontend: HttpFrontend, name: str,
               requests: int) -> dict[str, float]:
    """CPU µs per request of each tree: `SLICES` slices of the requests, the trees taking turns (so that a change
    in what else runs on the machine falls on both)."""
    _, app, model, connections, per_read, replay, share = CELLS[name]
    data = b"".join(request_bytes(model, 5 + index) for index in range(per_read))
    servers = {}
    for label, module in trees:
        served: Any = frontend if app == "model" else StubApp(later=app == "later")
        servers[label] = http = module.NativeHttpServer(served, "127.0.0.1", 0, LIMIT)
        http.replay = replay
    spent = dict.fromkeys(servers, 0.0)
    count = requests * share // SLICES
    for index in range(SLICES):
        for label, module in trees if index % 2 == 0 else trees[::-1]:
            spent[label] += await _drive(servers[label], module, connections, data, per_read, count)
    return {label: seconds / (count * SLICES) * 1e6 for label, seconds in spent.items()}


async def measure(repo: Path, trees: dict[str, ModuleType], rounds: int, requests: int) -> dict[str, list[float]]:
    server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                   allow_metrics=False))
    await server.start()
    ARRIVALS.bounded()  # as a server whose only frontend is the native HTTP one: a batch goes once no client can add
    for model in ("simple", "batched", "queued"):  # runs on the loop, as the pool decides for so short a model
        server.service._manager.get(model).scheduler._pool._typical_ns = 1
    frontend = HttpFrontend(server.service, LIMIT)
    results: dict[str, list[float]] = {}
    try:
        for index in range(rounds):
            order = list(trees.items()) if index % 2 == 0 else list(trees.items())[::-1]
            for name in CELLS:
                costs = await cell(order, frontend, name, requests)
                for label, cost in costs.items():
                    results.setdefault(f"{name}|{label}", []).append(cost)
                print(f"round {index + 1}: {name:14} " + "  ".join(f"{label} {cost:7.2f} µs" for label, cost in
                                                               costs.items()), flush=True)
    finally:
        await server.stop()
    return results


def load_baseline(spec: str) -> ModuleType:
    path = Path(spec)
    if not path.is_file():
        text = subprocess.run(["git", "show", f"{spec}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        path = Path(tempfile.mkdtemp(prefix="http-connection-")) / "native_server_baseline.py"
        path.write_text(text)
    loader = importlib.util.spec_from_file_location("native_server_baseline", path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.modules[loader.name] = module  # dataclasses look their module up
    loader.loader.exec_module(module)
    return module


def report(results: dict[str, list[float]], labels: list[str], rounds: int, requests: int) -> str:
    header = "| cell | " + " | ".join(f"{label} µs/request (median)" for label in labels)
    header += " | new / baseline |" if len(labels) == 2 else " |"
    lines = [
        "# The native HTTP connection's CPU per request (in-process, `simple`, no kernel, no client)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {rounds} rounds of {requests} requests per cell and tree (ten times as "
        f"many for a stub's), in {SLICES} slices the trees take turns at; event-loop thread CPU (time.thread_time) per "
        "request, ONNX Runtime's run included, medians over the rounds; "
        f"`.venv/bin/python bench/http_connection_bench.py {shlex.join(sys.argv[1:])}`",
        "",
        header,
        "|---|" + "---:|" * (len(labels) + (len(labels) == 2)),
    ]
    for name, (title, *_) in CELLS.items():
        medians = [statistics.median(results[f"{name}|{label}"]) for label in labels]
        row = f"| {title} | " + " | ".join(f"{m:.2f}" for m in medians)
        row += f" | {medians[0] / medians[1]:.3f} |" if len(labels) == 2 else " |"
        lines.append(row)
    lines += ["", "Every round (µs per request):", ""]
    for name in CELLS:
        for label in labels:
            values = ", ".join(f"{v:.2f}" for v in results[f"{name}|{label}"])
            lines.append(f"- {name}, {label}: {values}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--baseline", default="", help="a native_server.py file, or a git revision to take it from")
    parser.add_argument("--cells", default=",".join(CELLS), help="the cells to run, by name, comma-separated")
    args = parser.parse_args()
    for name in set(CELLS) - set(args.cells.split(",")):
        del CELLS[name]
    trees = {"new": native_server}
    if args.baseline:
        trees["baseline"] = load_baseline(args.baseline)
    with tempfile.TemporaryDirectory(prefix="http-connection-") as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        models.simple(repo, "simple")
        models.simple(repo, "batched", extra=BATCHED)
        models.simple(repo, "queued", extra=QUEUED)
        try:
            import uvloop  # the loop geserve serves on (cli.py)

            run: Any = uvloop.run
        except ImportError:
            run = asyncio.run
        results = run(measure(repo, trees, args.rounds, args.requests))
    text = report(results, list(trees), args.rounds, args.requests)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "http_connection.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
