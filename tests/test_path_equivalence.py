"""Equivalence by construction and by test (issue 32): one corpus of inference cases through every path a request can
take, the same answers, the same statistics, and the path that served each case asserted.

The request path is one (`InferenceService.submit`); how it runs a request is its run step's choice (`_shortcut`): at
once on the loop ("inline"), queued with a callback ("queued"), else in a task ("task"), counted in
`ge_inference_path_total`. `--inference-shortcuts off` takes every step in a task and turns off HTTP's replayed heads
and the remembered-header prepare memo. Three real server processes, started once for the module, serve the same
repository with `--inline-execution-us 10000000` (a short model runs on the loop once timed):

- `on`: the native HTTP/1.1 server (`HttpFrontend.begin`; a pipelined request: `_infer`) and the native HTTP/2 gRPC
  server (`GrpcInferenceServicer.begin`, `ModelStreamInfer`'s `start`), shortcuts on;
- `off`: the same servers with `--inference-shortcuts off`;
- `hosted`: `--http-server uvicorn` (the ASGI app: `respond` / `_infer`) and `--grpc-server grpcio` (grpc.aio's
  `ModelInfer`, awaited), shortcuts on.

Models: `simple` (dynamic batching, so "queued" serves it with shortcuts on), the conformance suites' unbatched and
batching ONNX models without a batcher (`nobatch`, `digits`, `identity_*`, "inline" once timed, which the module's
warm-up does), `py_simple` (a Python model, always "task") and `ens` (an ensemble of two `simple_direct` steps: the
ensemble in a task, each step an in-process call that runs inline).

The corpus: the HTTP and gRPC conformance tables (tests/test_conformance_http.py, tests/test_conformance_grpc.py,
shared-memory cases included, with the same `in` / `out` regions registered on every server), cases of our own for
the Python model, the ensemble and what the tables leave out (an output asked twice, bad
Inference-Header-Content-Length values, priority and timeout, a model error, bytes that are no message), and seeded
cases from tests/test_fuzz.py's generators. Every case is sent the same way to each server:

- HTTP: three times one after the other on one keep-alive connection (so remembered headers and replayed heads
  serve the later ones), then twice pipelined in one write (the second is `_infer`'s on the native server);
- gRPC unary: three ModelInfer calls on one channel;
- gRPC stream: one ModelStreamInfer call with three messages, sent in lockstep (each once the previous one was
  answered), and another with the three sent at once.

Compared across the servers of a protocol: each answer's status (gRPC code and details), every response header and
the body bytes (gRPC: the serialized message bytes as they came), the `out` region's bytes after the case, and the
change the case made to every model's counts (`/v2/models/stats`: inference and execution counts, every
inference_stats and batch_stats count; `/metrics`: success, failure by reason, pending, batch sizes). The repeats of
a case must answer alike on each server too. Left out, as they differ from run to run whatever the path: timings
(nanoseconds), a gzip body's MTIME (the second it was compressed), and for the streams sent at once how the batcher
of `simple` grouped them (execution counts, batch_stats, batch sizes: timing within its 1 ms queue delay).

Then the paths (`ge_inference_path_total`): with shortcuts off everything the models ran is "task"; with them on,
`simple` is "queued", the ONNX models without a batcher "inline", `py_simple` "task", and an `ens` request one "task"
and two "inline" steps; a request refused before its model runs (one past its deadline on arrival too) is counted on no
path. How many is the number of
requests the model ran (its success and failure counts in the same case). A failure's message carries the case's
table (server -> paths served, expected, statuses); `-s` prints the whole table after the run.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import select
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests import test_conformance_grpc as conformance_grpc
from tests import test_conformance_http as conformance_http
from tests import test_fuzz as fuzz
from tests.support import ensembles, models
from tests.support.server import RunningServer, start_geserve, stop_geserve
from tests.support.shm import Region

READ_TIMEOUT_S = 15.0
BATCHED = ("dynamic_batching { max_queue_delay_microseconds: 1000 default_queue_policy { timeout_action: REJECT "
           "allow_timeout_override: true } }")
COMMON_ARGS = ("--inline-execution-us", "10000000", "--allow-system-shared-memory=true")
INLINE_MODELS = ("nobatch", "digits", "identity_fp16", "identity_bool", "identity_bytes", "simple_direct")
# How a model's request runs with the shortcuts on: each path and how many of it one request of the model takes.
SHORTCUT_PATHS: dict[str, dict[str, int]] = {
    "simple": {"queued": 1},
    "py_simple": {"task": 1},
    "ens": {"task": 1, "inline": 2},  # the ensemble in a task, its two steps on the loop
    **{name: {"inline": 1} for name in INLINE_MODELS},
}
# What /metrics counts that must move alike (not timings, nor load-time gauges).
METRIC_COUNTS = (
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count", "nv_inference_exec_count",
    "nv_inference_pending_request_count", "ge_batch_size_bucket", "ge_batch_size_count", "ge_batch_size_sum",
)
SEQUENTIAL, PIPELINED = 3, 2  # HTTP sends of each case: one after the other, then in one write

_PY_SIMPLE = '''"""`simple` as a Python model: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (INT32 [16]).
A request whose first INPUT0 value is -999 is answered with an error; -998 makes execute() raise."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            first = a.reshape(-1)[0] if a.size else 0
            if first == -998:
                raise ValueError("py_simple was asked to raise")
            if first == -999:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("py_simple was asked to fail")))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                         pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''


def build_repository(repo: Path) -> Path:
    repo.mkdir(parents=True)
    models.simple(repo, extra=BATCHED)
    models.simple(repo, "simple_direct")
    models.nobatch(repo)
    models.digits(repo)
    for kind in ("fp16", "bool", "bytes"):
        models.identity(repo, kind)
    py = models.simple(repo, "py_simple")
    (py / "1" / "model.onnx").unlink()
    (py / "1" / "model.py").write_text(_PY_SIMPLE)
    config = (py / "config.pbtxt").read_text()
    (py / "config.pbtxt").write_text(config.replace('backend: "onnxruntime"', 'backend: "python"'))
    ensembles.chain("ens", "simple_direct").write(repo)
    return repo


# ------------------------------------------------------------------------------------------------ the servers


@dataclass(frozen=True)
class Flavour:
    name: str
    args: tuple[str, ...]
    shortcuts: bool
    http: str  # what serves HTTP, as the tables name it
    grpc: str


FLAVOURS = (
    Flavour("on", (), True, "native", "h2"),
    Flavour("off", ("--inference-shortcuts", "off"), False, "native/off", "h2/off"),
    Flavour("hosted", ("--http-server", "uvicorn", "--grpc-server", "grpcio"), True, "uvicorn", "grpc.aio"),
)


@dataclass(frozen=True)
class Reply:
    """One HTTP answer as it came: status, every header (lower-case names, in order) and the body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def short(self) -> str:
        return str(self.status)


CLOSED = Reply(0, (), b"<connection closed before an answer>")


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed this idle connection: it reads as ended (nothing is owed on it)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _without_gzip_time(body: bytes, headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """A gzip body with its header's MTIME (bytes 4 to 8, the second it was compressed) zeroed: the one thing in an
    answer that differs from run to run, whatever the path."""
    if (b"content-encoding", b"gzip") in headers and body[:2] == b"\x1f\x8b" and len(body) >= 8:
        return body[:4] + bytes(4) + body[8:]
    return body


class Wire:
    """One keep-alive HTTP connection, written raw: a case's bytes go out exactly as built, to every server."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.buffer = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.buffer = None, b""

    def exchange(self, raw: bytes, count: int) -> list[Reply]:
        """`raw` sent `count` times in one write; the answers, CLOSED for each the server closed the connection
        before answering (a fresh connection then serves the next exchange)."""
        if self.sock is not None and _closed_by_peer(self.sock):  # a server's idle timeout, between cases
            self.close()
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=READ_TIMEOUT_S)
        with contextlib.suppress(OSError):  # a server that refused halfway may close before reading it all
            self.sock.sendall(raw * count)
        replies: list[Reply] = []
        closing = False
        while len(replies) < count and not closing:
            reply = self._next()
            if reply is None:
                break
            replies.append(reply)
            closing = (b"connection", b"close") in [(k, v.lower()) for k, v in reply.headers]
        if closing or len(replies) < count:
            self.close()
        return replies + [CLOSED] * (count - len(replies))

    def _next(self) -> Reply | None:
        while True:
            reply = self._parse()
            if reply is not None:
                return reply
            try:
                chunk = self.sock.recv(1 << 16) if self.sock is not None else b""
            except (ConnectionResetError, TimeoutError):
                chunk = b""
            if not chunk:
                return None
            self.buffer += chunk

    def _parse(self) -> Reply | None:
        """The first complete answer in the buffer (an interim 100 dropped), taken out of it; None if incomplete."""
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            headers = tuple((k.strip().lower(), v.strip()) for k, v in (line.split(b":", 1) for line in lines[1:]))
            if status == 100:
                self.buffer = rest
                continue
            length = int(dict(headers).get(b"content-length", b"0"))
            if len(rest) < length:
                return None
            self.buffer = rest[length:]
            return Reply(status, headers, _without_gzip_time(rest[:length], headers))
        return None


@dataclass(frozen=True)
class GrpcAnswer:
    """A unary call's status, details and response bytes as they came."""

    code: str
    details: str
    body: bytes

    def short(self) -> str:
        return self.code


@dataclass(frozen=True)
class StreamAnswer:
    """What one ModelStreamInfer call answered: every message's bytes, then how the call ended."""

    messages: tuple[bytes, ...]
    code: str
    details: str

    def short(self) -> str:
        errors = sum(bool(pb.ModelStreamInferResponse.FromString(m).error_message) for m in self.messages)
        return f"{len(self.messages)} msgs ({errors} in-band errors) {self.code}"


MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class Probe:
    """One server of the module: its wires, and its counts as the last case left them."""

    def __init__(self, flavour: Flavour, server: RunningServer, out_region: Region) -> None:
        self.flavour = flavour
        self.server = server
        self.out_region = out_region
        self.wire = Wire(server.http_port)
        self.control = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=READ_TIMEOUT_S)
        self.metrics = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=READ_TIMEOUT_S)
        self.channel = grpc.insecure_channel(server.grpc_url)
        # No (de)serializers: the bytes of a case go out as built, the answers' bytes come back as sent.
        self.unary: Any = self.channel.unary_unary(MODEL_INFER)
        self.stream: Any = self.channel.stream_stream(MODEL_STREAM_INFER)
        self.last: dict[str, int] | None = None
        self.open = False  # a case began here and has not ended (it broke off): its counts are not to be trusted

    def close(self) -> None:
        self.wire.close()
        self.control.close()
        self.metrics.close()
        self.channel.close()

    def _get(self, connection: http.client.HTTPConnection, path: str) -> bytes:
        for attempt in range(2):  # once more on a fresh connection if the server closed an idle one
            try:
                connection.request("GET", path)
                response = connection.getresponse()
                body = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionError):
                connection.close()
                if attempt:
                    raise
        assert response.status == 200, (path, body[:300])
        return body

    def counts(self) -> dict[str, int]:
        """Every count of every model (statistics and metrics), and the paths (`path <name>`); no timings."""
        counts: dict[str, int] = {}
        for entry in json.loads(self._get(self.control, "/v2/models/stats"))["model_stats"]:
            model = entry["name"]
            counts[f"{model} inference_count"] = entry["inference_count"]
            counts[f"{model} execution_count"] = entry["execution_count"]
            for key, value in entry["inference_stats"].items():
                counts[f"{model} {key}"] = value["count"]
            for batch in entry["batch_stats"]:
                for key, value in batch.items():
                    if key != "batch_size":
                        counts[f"{model} batch {batch['batch_size']} {key}"] = value["count"]
        for line in self._get(self.metrics, "/metrics").decode().splitlines():
            sample, _, value = line.rpartition(" ")
            name = sample.split("{", 1)[0]
            if name == "ge_inference_path_total":
                counts["path " + sample.split('path="', 1)[1].split('"', 1)[0]] = int(float(value))
            elif name in METRIC_COUNTS:
                counts[sample] = int(float(value))
        return counts

    def begin(self) -> None:
        """Before a case's traffic: the counts it starts from (the last case's, unless that one broke off)."""
        if self.last is None or self.open:
            self.last = self.counts()
        self.open = True
        self.out_region.memory[:] = bytes(len(self.out_region.memory))

    def end(self) -> tuple[dict[str, int], dict[str, int], bytes]:
        """After a case's traffic: what it changed (statistics, paths) and the `out` region as it left it."""
        before, after = self.last or {}, self.counts()
        self.last, self.open = after, False
        change = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        paths = {k[5:]: change.pop(k) for k in list(change) if k.startswith("path ")}
        return change, paths, bytes(self.out_region.memory)


@dataclass
class Servers:
    probes: list[Probe]
    regions: tuple[Region, Region]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("path-equivalence")
    repo = build_repository(root / "models")
    regions = (Region(256, prefix="geserve-paths"), Region(256, prefix="geserve-paths"))
    regions[0].memory[: conformance_http.SHM_IN_SIZE] = conformance_http.SHM_IN
    running: list[RunningServer] = []
    probes: list[Probe] = []
    try:
        with ThreadPoolExecutor(len(FLAVOURS)) as pool:
            starting = [pool.submit(start_geserve, [repo], root / f"{f.name}.log", [*COMMON_ARGS, *f.args])
                        for f in FLAVOURS]
            for future in starting:
                with contextlib.suppress(Exception):
                    running.append(future.result())
            for future in starting:
                future.result()  # raises the first failure, the servers that did start stopped below
        for flavour, server in zip(FLAVOURS, running, strict=True):
            probe = Probe(flavour, server, regions[1])
            probes.append(probe)
            for name, region in (("in", regions[0]), ("out", regions[1])):
                body = json.dumps({"key": region.key, "offset": 0, "byte_size": 256}).encode()
                reply = probe.wire.exchange(fuzz.http(b"POST", f"/v2/systemsharedmemory/region/{name}/register"
                                                      .encode(), body), 1)[0]
                assert reply.status == 200, reply
            warm_up(probe)
        yield Servers(probes, regions)
    finally:
        for probe in probes:
            probe.close()
        for server in running:
            stop_geserve(server)
        for region in regions:
            region.close()


def warm_up(probe: Probe) -> None:
    """Two requests of each model: the ONNX models without a batcher are timed, and run on the loop from now on."""
    for model, body in (
        ("simple", conformance_http.simple_json()), ("simple_direct", conformance_http.simple_json()),
        ("py_simple", conformance_http.simple_json()), ("ens", ENS_JSON),
        ("nobatch", conformance_http._NOBATCH_JSON), ("digits", conformance_http.digits_json(1)),
        ("identity_fp16", FP16_JSON), ("identity_bool", BOOL_JSON), ("identity_bytes", BYTES_JSON),
    ):
        for _ in range(2):
            (reply,) = probe.wire.exchange(fuzz.http(b"POST", f"/v2/models/{model}/infer".encode(),
                                                     json.dumps(body).encode()), 1)
            assert reply.status == 200, (probe.flavour.name, model, reply)


# ------------------------------------------------------------------------------------------------ the checks


@dataclass
class Seen:
    """What one server answered to a case, and what the case changed there."""

    label: str
    shortcuts: bool
    answers: list[Any]
    counts: dict[str, int]
    paths: dict[str, int]
    region: bytes


TABLE: dict[str, dict[str, str]] = {}  # case -> server -> what served it, printed by the last test


def runs_of(model: str | None, counts: dict[str, int]) -> int:
    """How many requests `model` ran (succeeded or failed in it) in a case: the ones a path must have counted."""
    if model is None or model not in SHORTCUT_PATHS:
        return 0
    # A request whose deadline passed before it arrived fails, counted, before the run step: on no path.
    late = next((n for sample, n in counts.items() if sample.startswith("nv_inference_request_failure{")
                 and f'model="{model}"' in sample and 'reason="DEADLINE_EXCEEDED"' in sample), 0)
    return counts.get(f"{model} success", 0) + counts.get(f"{model} fail", 0) - late


def expected_paths(model: str | None, runs: int, shortcuts: bool) -> dict[str, int]:
    if not runs or model is None:
        return {}
    taken = SHORTCUT_PATHS[model]
    if not shortcuts:
        return {"task": runs * sum(taken.values())}
    return {path: runs * count for path, count in taken.items()}


def show_paths(paths: dict[str, int]) -> str:
    return " ".join(f"{p}x{n}" for p, n in sorted(paths.items())) or "-"


def table(case: str, seen: list[Seen], model: str | None, runs: int) -> str:
    rows = [f"case {case} (model {model}, runs {runs}):"]
    width = max(len(s.label) for s in seen)
    for s in seen:
        statuses = ", ".join(a.short() for a in s.answers)
        rows.append(f"  {s.label:<{width}}  paths {show_paths(s.paths):<22} expected "
                    f"{show_paths(expected_paths(model, runs, s.shortcuts)):<22} answers [{statuses}]")
    return "\n".join(rows)


def check(case: str, model: str | None, seen: list[Seen]) -> None:
    """Every server answered alike, counted alike, and served the case on the path its settings imply."""
    reference = seen[0]
    runs = runs_of(model, reference.counts)
    shown = table(case, seen, model, runs)
    TABLE[case] = {s.label: show_paths(s.paths) for s in seen}
    for other in seen[1:]:
        for index, (a, b) in enumerate(zip(reference.answers, other.answers, strict=True)):
            assert a == b, f"answer {index + 1} differs, {reference.label} vs {other.label}:\n{a!r}\n{b!r}\n{shown}"
        assert other.counts == reference.counts, (
            f"statistics differ, {reference.label} vs {other.label}:\n{reference.counts}\n{other.counts}\n{shown}")
        assert other.region == reference.region, f"the out region differs, {reference.label} vs {other.label}\n{shown}"
    for s in seen:
        assert s.paths == expected_paths(model, runs, s.shortcuts), f"{s.label} served another path\n{shown}"


# ------------------------------------------------------------------------------------------------ HTTP corpus


@dataclass(frozen=True)
class HttpCase:
    id: str
    raw: bytes | Callable[[], bytes]  # the whole request; a function where the data is built with the servers
    marks: tuple[Any, ...] = ()

    def request(self) -> bytes:
        return self.raw() if callable(self.raw) else self.raw


_INFER_PATH = re.compile(rb"^POST /v2/models/([^/?\s]+)(?:/versions/[^/\s]+)?/infer[\s?]")


def model_of(raw: bytes) -> str | None:
    found = _INFER_PATH.match(raw)
    return found.group(1).decode("latin-1") if found else None


def _http_raw(url: str, body: Any, headers: dict[str, str]) -> bytes:
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    return fuzz.http(b"POST", url.encode(), data, tuple((k.encode(), v.encode()) for k, v in headers.items()))


def _from_table(case: Any) -> HttpCase:
    """A conformance table's row (Infer or Bad) as raw bytes; digits rows are built once the servers run."""
    if callable(case.body):
        return HttpCase(f"conf-{case.id}", lambda: _http_raw(case.url, case.body(), case.headers))
    return HttpCase(f"conf-{case.id}", _http_raw(case.url, case.body, case.headers))


def _json_case(id: str, model: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> HttpCase:
    return HttpCase(id, _http_raw(f"/v2/models/{model}/infer", body, headers or {}))


def _binary_case(id: str, model: str, header: dict[str, Any], payload: bytes, length: str | None = None) -> HttpCase:
    head = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(head)) if length is None else length}
    return HttpCase(id, _http_raw(f"/v2/models/{model}/infer", head + payload, headers))


A, B = conformance_http.A, conformance_http.B
SIMPLE_JSON = conformance_http.simple_json()
SIMPLE_BINARY = conformance_http.simple_inputs(binary=True)
ENS_JSON = {"inputs": [{**t, "name": n} for t, n in zip(SIMPLE_JSON["inputs"], ("A", "B"), strict=True)]}
FP16_JSON = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP16", "data": [1.5, -2.25, 65504.0, 0.1]}]}
BOOL_JSON = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BOOL", "data": [True, False, True]}]}
BYTES_JSON = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "data": ["a", "bc"]}]}
_FAILING = {"inputs": [{**SIMPLE_JSON["inputs"][0], "data": [-999, *A[1:].tolist()]}, SIMPLE_JSON["inputs"][1]]}
_RAISING = {"inputs": [{**SIMPLE_JSON["inputs"][0], "data": [-998, *A[1:].tolist()]}, SIMPLE_JSON["inputs"][1]]}
_TWICE = {**SIMPLE_JSON, "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]}
_BIN_OUT = {"parameters": {"binary_data_output": True}}


def _own_http_cases() -> list[HttpCase]:
    cases = []
    for model in ("simple", "simple_direct", "py_simple"):
        cases += [
            _json_case(f"{model}-json", model, SIMPLE_JSON),
            _binary_case(f"{model}-binary", model, {**SIMPLE_BINARY[0], **_BIN_OUT}, SIMPLE_BINARY[1]),
            # headers a server may remember (binary inputs, no id nor parameters): in order, and in reverse
            _binary_case(f"{model}-binary-remembered", model, {**SIMPLE_BINARY[0], "outputs": [
                {"name": "OUTPUT1", "parameters": {"binary_data": True}}, {"name": "OUTPUT0"}]}, SIMPLE_BINARY[1]),
            _binary_case(f"{model}-binary-inputs-reversed", model, {"inputs": SIMPLE_BINARY[0]["inputs"][::-1]},
                         B.tobytes() + A.tobytes()),
            _json_case(f"{model}-request-id", model, {**SIMPLE_JSON, "id": "echo-me"}),
            _json_case(f"{model}-priority-timeout", model, {**SIMPLE_JSON, "parameters": {"priority": 1,
                                                                                          "timeout": 5_000_000}}),
            _json_case(f"{model}-queue-timeout-expires", model, {**SIMPLE_JSON, "parameters": {"timeout": 1}}),
            _json_case(f"{model}-classification", model, {**SIMPLE_JSON, "outputs": [
                {"name": "OUTPUT1", "parameters": {"classification": 3}}]}),
            _json_case(f"{model}-output-asked-twice", model, _TWICE),
            _json_case(f"{model}-shm-in-and-out", model, conformance_http._shm_simple(64, 64,
                                                                                     *conformance_http._SHM_OUT)),
            _json_case(f"{model}-wrong-datatype", model, {"inputs": [
                {**SIMPLE_JSON["inputs"][0], "datatype": "FP32"}, SIMPLE_JSON["inputs"][1]]}),
            _json_case(f"{model}-missing-input", model, {"inputs": SIMPLE_JSON["inputs"][:1]}),
            HttpCase(f"{model}-unknown-version", _http_raw(f"/v2/models/{model}/versions/3/infer", SIMPLE_JSON, {})),
            _binary_case(f"{model}-header-length-not-a-number", model, SIMPLE_BINARY[0], SIMPLE_BINARY[1], "abc"),
            _binary_case(f"{model}-header-length-negative", model, SIMPLE_BINARY[0], SIMPLE_BINARY[1], "-1"),
            _binary_case(f"{model}-header-length-short", model, SIMPLE_BINARY[0], SIMPLE_BINARY[1], "10"),
        ]
    cases += [
        _json_case("py_simple-model-error", "py_simple", _FAILING),
        _json_case("py_simple-model-raises", "py_simple", _RAISING),
        _json_case("ens-json", "ens", ENS_JSON),
        _json_case("ens-request-id-binary-out", "ens", {**ENS_JSON, "id": "ens-id", **_BIN_OUT}),
        _json_case("ens-missing-input", "ens", {"inputs": ENS_JSON["inputs"][:1]}),
        _json_case("ens-wrong-shape", "ens", {"inputs": [{**ENS_JSON["inputs"][0], "shape": [1, 15],
                                                          "data": A[:15].tolist()}, ENS_JSON["inputs"][1]]}),
        _json_case("ens-one-output", "ens", {**ENS_JSON, "outputs": [{"name": "DIFF"}]}),
        _json_case("nobatch-output-asked-twice", "nobatch", {**conformance_http._NOBATCH_JSON,
                                                             "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]}),
        HttpCase("bad-json-unknown-model", _http_raw("/v2/models/nope/infer", b"{bad", {})),
    ]
    return cases


def _fuzz_http_cases(count: int = 12) -> list[HttpCase]:
    """test_fuzz's pipelined cases (right framing, any content) whose route is an inference, first seeds first."""
    cases: list[HttpCase] = []
    seed = fuzz.DEFAULT_SEED
    while len(cases) < count:
        raw = fuzz.pipelined_case(random.Random(seed), "/geserve-paths-no-region")
        if _INFER_PATH.match(raw):
            cases.append(HttpCase(f"fuzz-{seed}", raw))
        seed += 1
    return cases


def _inline_twins(cases: list[HttpCase]) -> list[HttpCase]:
    """The cases of `simple` (queued with the shortcuts on) sent to `simple_direct` too (the same model without a
    batcher: on the loop), so both shortcuts see the whole table."""
    return [HttpCase(f"direct-{c.id}", c.raw.replace(b"/v2/models/simple/", b"/v2/models/simple_direct/", 1))
            for c in cases if isinstance(c.raw, bytes) and model_of(c.raw) == "simple"]


_TABLE_HTTP = [_from_table(c) for c in conformance_http.INFERS + conformance_http.BADS]
HTTP_CASES = [*_TABLE_HTTP, *_inline_twins(_TABLE_HTTP), *_own_http_cases(), *_fuzz_http_cases()]


def _param(case: Any) -> Any:
    return pytest.param(case, id=case.id, marks=case.marks)


@pytest.mark.parametrize("case", [_param(c) for c in HTTP_CASES])
def test_http_paths_answer_alike(servers: Servers, case: HttpCase) -> None:
    raw = case.request()
    seen = []
    for probe in servers.probes:
        probe.begin()
        answers = [probe.wire.exchange(raw, 1)[0] for _ in range(SEQUENTIAL)]
        answers += probe.wire.exchange(raw, PIPELINED)
        counts, paths, region = probe.end()
        seen.append(Seen(probe.flavour.http, probe.flavour.shortcuts, answers, counts, paths, region))
    check(f"http {case.id}", model_of(raw), seen)
    # The repeats answer alike too: a replayed head, a remembered header, a pipelined request.
    for s in seen:
        answered = [a for a in s.answers if a is not CLOSED]
        assert all(a == answered[0] for a in answered), f"{s.label}: repeats answered differently\n{answered}"


# ------------------------------------------------------------------------------------------------ gRPC corpus


@dataclass(frozen=True)
class GrpcCase:
    id: str
    build: pb.ModelInferRequest | bytes | Callable[[], pb.ModelInferRequest]
    marks: tuple[Any, ...] = ()

    def request(self) -> bytes:
        built = self.build() if callable(self.build) else self.build
        return built if isinstance(built, bytes) else built.SerializeToString()


def grpc_model_of(data: bytes) -> str | None:
    try:
        return str(pb.ModelInferRequest.FromString(data).model_name)
    except Exception:  # no message: no model
        return None


G = conformance_grpc


def _renamed(request: pb.ModelInferRequest, model: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest.FromString(request.SerializeToString())
    request.model_name = model
    return request


def _ens(**fields: Any) -> pb.ModelInferRequest:
    return G.infer("ens", ("A", "INT32", [1, 16], A.tobytes()), ("B", "INT32", [1, 16], B.tobytes()), **fields)


def _first(value: int) -> pb.ModelInferRequest:
    return G.simple(a=np.array([value, *A[1:].tolist()], dtype=np.int32))


def _own_grpc_cases() -> list[GrpcCase]:
    cases = []
    for model in ("simple", "simple_direct", "py_simple"):
        cases += [
            GrpcCase(f"{model}-raw", _renamed(G.simple(), model)),
            GrpcCase(f"{model}-typed", _renamed(G.simple_typed(), model)),
            GrpcCase(f"{model}-inputs-reversed", G.infer(model, ("INPUT1", "INT32", [1, 16], B.tobytes()),
                                                         ("INPUT0", "INT32", [1, 16], A.tobytes()))),
            GrpcCase(f"{model}-request-id", _renamed(G.simple(id="echo-me"), model)),
            GrpcCase(f"{model}-priority-timeout", _renamed(G.with_parameters(G.simple(), {
                "priority": ("int64_param", 1), "timeout": ("int64_param", 5_000_000)}), model)),
            GrpcCase(f"{model}-queue-timeout-expires", _renamed(G.with_parameters(G.simple(), {
                "timeout": ("int64_param", 1)}), model)),
            GrpcCase(f"{model}-classification", _renamed(G.with_outputs(G.simple(), (
                "OUTPUT1", {"classification": ("int64_param", 3)})), model)),
            GrpcCase(f"{model}-output-asked-twice", _renamed(G.with_outputs(G.simple(), ("OUTPUT0", {}),
                                                                            ("OUTPUT0", {})), model)),
            GrpcCase(f"{model}-missing-input", _renamed(G._edit(G.simple(), lambda r: (
                r.inputs.pop(), r.raw_input_contents.pop())), model)),
            GrpcCase(f"{model}-unknown-version", _renamed(G.simple(model_version="3"), model)),
            GrpcCase(f"{model}-shm-in-and-out", _renamed(G._shm_request(), model)),
        ]
    cases += [
        GrpcCase("py_simple-model-error", _renamed(_first(-999), "py_simple")),
        GrpcCase("py_simple-model-raises", _renamed(_first(-998), "py_simple")),
        GrpcCase("ens-raw", _ens()),
        GrpcCase("ens-request-id", _ens(id="ens-id")),
        GrpcCase("ens-one-output", G.with_outputs(_ens(), ("SUM", {}))),
        GrpcCase("ens-missing-input", G._edit(_ens(), lambda r: (r.inputs.pop(), r.raw_input_contents.pop()))),
        GrpcCase("not-a-message", b"\xff\xff\xff\xff"),
    ]
    return cases


def _fuzz_grpc_cases(count: int = 12) -> list[GrpcCase]:
    """test_fuzz's ModelInfer messages: fuzzed fields half the time, mutated bytes of a valid request the other."""
    cases = []
    for seed in range(fuzz.DEFAULT_SEED, fuzz.DEFAULT_SEED + count):
        rng = random.Random(seed)
        if seed % 2:
            data = fuzz.mutate(rng, fuzz.grpc_simple().SerializeToString())
        else:
            data = fuzz.grpc_infer(rng).SerializeToString()
        cases.append(GrpcCase(f"fuzz-{seed}", data))
    return cases


def _direct(build: Any) -> Callable[[], pb.ModelInferRequest]:
    """A conformance request of `simple` sent to `simple_direct` instead (see `_inline_twins`)."""
    return lambda: _renamed(build() if callable(build) else build, "simple_direct")


def _model_at_import(build: Any) -> str | None:
    """The model a table's request names; None for one that cannot be built before the servers run (digits data)."""
    try:
        return grpc_model_of(GrpcCase("", build).request())
    except Exception:
        return None


_TABLE_GRPC = [(id, build) for id, build, *_ in G.INFERS + G.BADS]
GRPC_CASES = [
    *(GrpcCase(f"conf-{id}", build) for id, build in _TABLE_GRPC),
    *(GrpcCase(f"direct-{id}", _direct(build)) for id, build in _TABLE_GRPC if _model_at_import(build) == "simple"),
    *_own_grpc_cases(),
    *_fuzz_grpc_cases(),
]


_BATCHING = re.compile(r"execution_count|exec_count|\bbatch\b|ge_batch_size")  # how requests were grouped


def unary(probe: Probe, data: bytes) -> GrpcAnswer:
    try:
        return GrpcAnswer("OK", "", probe.unary(data, timeout=READ_TIMEOUT_S))
    except grpc.RpcError as exc:
        return GrpcAnswer(exc.code().name, exc.details() or "", b"")


def stream(probe: Probe, data: bytes, count: int, lockstep: bool) -> StreamAnswer:
    """One ModelStreamInfer call carrying `data` `count` times: in lockstep (each message once the previous one was
    answered) or all at once."""
    answered = threading.Semaphore(0)

    def messages_to_send() -> Iterator[bytes]:
        for index in range(count):
            if lockstep and index and not answered.acquire(timeout=READ_TIMEOUT_S):
                return
            yield data

    messages: list[bytes] = []
    try:
        for message in probe.stream(messages_to_send(), timeout=READ_TIMEOUT_S):
            messages.append(message)
            answered.release()
    except grpc.RpcError as exc:
        return StreamAnswer(tuple(messages), exc.code().name, exc.details() or "")
    return StreamAnswer(tuple(messages), "OK", "")


@pytest.mark.parametrize("case", [_param(c) for c in GRPC_CASES])
def test_grpc_unary_paths_answer_alike(servers: Servers, case: GrpcCase) -> None:
    data = case.request()
    seen = []
    for probe in servers.probes:
        probe.begin()
        answers = [unary(probe, data) for _ in range(SEQUENTIAL)]
        counts, paths, region = probe.end()
        seen.append(Seen(probe.flavour.grpc, probe.flavour.shortcuts, answers, counts, paths, region))
    check(f"grpc {case.id}", grpc_model_of(data), seen)
    for s in seen:
        assert all(a == s.answers[0] for a in s.answers), f"{s.label}: repeats answered differently\n{s.answers}"


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "burst"])
@pytest.mark.parametrize("case", [_param(c) for c in GRPC_CASES])
def test_grpc_stream_paths_answer_alike(servers: Servers, case: GrpcCase, lockstep: bool) -> None:
    """A stream's messages sent in lockstep are each a batch of their own, as every other case's; sent at once, how
    many of them the batcher of `simple` finds waiting is timing (1 ms of queue delay), not path: the burst compares
    everything but how the requests were batched (execution counts, batch_stats, batch sizes)."""
    data = case.request()
    seen = []
    for probe in servers.probes:
        probe.begin()
        answers = [stream(probe, data, SEQUENTIAL, lockstep)]
        counts, paths, region = probe.end()
        if not lockstep:
            counts = {k: v for k, v in counts.items() if not _BATCHING.search(k)}
        seen.append(Seen(f"{probe.flavour.grpc} stream", probe.flavour.shortcuts, answers, counts, paths, region))
    check(f"grpc-stream-{'lockstep' if lockstep else 'burst'} {case.id}", grpc_model_of(data), seen)


def test_the_table_of_paths_served() -> None:
    """Last: the table of case -> path served per server (shown with -s, or -rP); after a whole run, every path was
    taken on every server whose settings have it (a corpus refused before running anything would prove nothing)."""
    served: dict[str, set[str]] = {}
    for case, row in TABLE.items():
        print(f"{case:<70} " + "  ".join(f"{label}: {paths}" for label, paths in row.items()))
        for label, paths in row.items():
            served.setdefault(label, set()).update(p.split("x")[0] for p in paths.split() if p != "-")
    if len(TABLE) < len(HTTP_CASES) + 3 * len(GRPC_CASES):
        return  # a selection of the cases ran (-k): nothing to say about the paths they took
    for flavour in FLAVOURS:
        for label in (flavour.http, flavour.grpc, f"{flavour.grpc} stream"):
            wanted = {"inline", "queued", "task"} if flavour.shortcuts else {"task"}
            assert served.get(label) == wanted, (label, served.get(label))
