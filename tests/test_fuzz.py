"""Fuzzing the wire: mutated HTTP requests over raw sockets and random or mutated gRPC messages on every RPC, all
sent to one real geserve process on 127.0.0.1.

Seeded: GESERVE_FUZZ_SEED (default `DEFAULT_SEED`) picks every case; the seed is printed, so a failure reruns
exactly. Bounded: ~2,500 HTTP requests (most pipelined, 40 to a keep-alive connection; framing faults one to a
connection, all open at once) and 1,200 gRPC calls (50 in flight at a time) take a few seconds; every read has a
timeout. What must hold whatever arrives:

- HTTP: no 5xx but the deliberate ones, each Triton's own answer:
  501: an unknown Content-Encoding or transfer coding ("Unsupported compression type"), a log_file change;
  503: load / unload in "none" model control mode, an invalid log_format, a server that is exiting;
  500: shared memory failures Triton answers 500 (`DELIBERATE_500`: a key that does not open, a region past the
  end of its object, an output that does not fit its window);
- gRPC: a definite status, never UNKNOWN nor DEADLINE_EXCEEDED; INTERNAL only for those same shared memory
  failures;
- every complete request is answered (a framing fault by a 4xx and a close), none hangs the server;
- the server process stays alive, answers the next valid request correctly after each batch, and its RSS grows by
  less than `RSS_GROWTH_LIMIT` over the whole run.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import random
import re
import resource
import selectors
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from tests.support import models
from tests.support.server import RunningServer, geserve
from tests.support.shm import Region

DEFAULT_SEED = 20261201
SEED = int(os.environ.get("GESERVE_FUZZ_SEED", DEFAULT_SEED))
HTTP_PIPELINED = 2200  # body, header and path faults on keep-alive connections
HTTP_FRAMING = 320  # framing faults, one connection each
GRPC_CALLS = 1200
PIPELINE_DEPTH = 40
RSS_GROWTH_LIMIT = 50 * 2**20
MAX_INPUT = 4 * 2**20  # --http-max-input-size: keeps "too large" cases cheap
READ_TIMEOUT_S = 10.0

DELIBERATE_5XX = {501, 503}
DELIBERATE_500 = (
    "Unable to open shared memory region", "Invalid shared memory region",
    "shared memory size specified with the request for output",
)
GRPC_DEFINITE = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS,
}

A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)
VALID_INFER = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": A.tolist()},
    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": B.tolist()},
]}).encode()


@dataclass
class Fuzzed:
    """What one run saw, for the summary and the assertions."""

    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    requests: int = 0

    def fail(self, what: str, case: bytes | str) -> None:
        shown = case if isinstance(case, str) else case[:300].decode("latin-1")
        self.failures.append(f"{what}: {shown!r}")


@pytest.fixture(scope="module")
def region() -> Iterator[Region]:
    shm = Region(4096, prefix="geserve-fuzz")
    try:
        yield shm
    finally:
        shm.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, region: Region) -> Iterator[RunningServer]:
    """A server of its own: its memory is measured, and the shared session server is spared the garbage."""
    repo = tmp_path_factory.mktemp("fuzz") / "models"
    repo.mkdir()
    models.simple(repo)
    models.nobatch(repo)
    models.identity(repo, "bytes")
    models.identity(repo, "fp16")
    args = ["--allow-system-shared-memory=true", f"--http-max-input-size={MAX_INPUT}"]
    with geserve([repo], repo.parent / "geserve.log", args) as running:
        yield running


# ------------------------------------------------------------------------------------------------ HTTP wire


def http(method: bytes, path: bytes, body: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = (),
         length: bytes | None = None) -> bytes:
    head = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1"]
    head += [name + b": " + value for name, value in headers]
    head.append(b"Content-Length: " + (str(len(body)).encode() if length is None else length))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def parse_responses(buffer: bytes) -> tuple[list[Response], bytes]:
    """Complete responses at the front of `buffer` (interim 100s dropped) and what is left."""
    responses = []
    while b"\r\n\r\n" in buffer:
        head, rest = buffer.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(b":", 1) for line in lines[1:])
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        if status == 100:
            buffer = rest
            continue
        length = int(headers[b"content-length"])
        if len(rest) < length:
            break
        responses.append(Response(status, headers, rest[:length]))
        buffer = rest[length:]
    return responses, buffer


def check_response(run: Fuzzed, response: Response, case: bytes) -> None:
    run.statuses[f"http {response.status}"] += 1
    if response.status < 500 or response.status in DELIBERATE_5XX:
        return
    try:
        message = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        message = ""
    if response.status == 500 and message.startswith(DELIBERATE_500):
        return
    run.fail(f"HTTP {response.status} {response.body[:200]!r}", case)


def pipeline(port: int, requests: list[bytes], run: Fuzzed) -> None:
    """Send `requests` pipelined on keep-alive connections, PIPELINE_DEPTH to a connection. A connection the server
    closes on purpose (its last response says `connection: close`) is replaced and the rest sent again."""
    pending = list(requests)
    while pending:
        batch, pending = pending[:PIPELINE_DEPTH], pending[PIPELINE_DEPTH:]
        with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as sock:
            sock.sendall(b"".join(batch))
            buffer, answered = b"", 0
            while answered < len(batch):
                try:
                    chunk = sock.recv(1 << 16)
                except (ConnectionResetError, TimeoutError) as exc:
                    run.fail(f"no answer ({type(exc).__name__}) after {answered} of {len(batch)}", batch[answered])
                    return
                responses, buffer = parse_responses(buffer + chunk)
                for response in responses:
                    check_response(run, response, batch[answered])
                    answered += 1
                    run.requests += 1
                    if response.headers.get(b"connection", b"").lower() == b"close" and answered < len(batch):
                        pending = batch[answered:] + pending
                        batch = batch[:answered]
                        break
                if not chunk and answered < len(batch):
                    run.fail(f"closed without answering after {answered} of {len(batch)}", batch[answered])
                    return


@dataclass
class Framing:
    """A request with a framing fault, alone on its connection. `answered`: the server must answer (a 4xx) or
    close before the deadline; otherwise it may also wait for bytes that never come (we hang up)."""

    raw: bytes
    answered: bool
    hang_up: bool = False  # close right after sending: a body announced longer than sent, abandoned


def exchange_framing(port: int, cases: list[Framing], run: Fuzzed, deadline_s: float = 4.0) -> None:
    """All the cases at once, each on its own connection; read until each closes or the deadline passes."""
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    owners: dict[socket.socket, Framing] = {}
    for case in cases:
        sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
        with contextlib.suppress(OSError):  # refused halfway (a 431 or 400 before all was sent): read what came
            sock.sendall(case.raw)
        run.requests += 1
        if case.hang_up:
            sock.close()
            continue
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        buffers[sock], owners[sock] = bytearray(), case
    closed: set[socket.socket] = set()
    end = time.monotonic() + deadline_s
    while len(closed) < len(buffers) and time.monotonic() < end:
        for key, _ in selector.select(timeout=0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                chunk = sock.recv(1 << 16)
            except (ConnectionResetError, BlockingIOError):
                chunk = b""
            if chunk:
                buffers[sock] += chunk
            else:
                selector.unregister(sock)
                closed.add(sock)
    for sock, data in buffers.items():
        case = owners[sock]
        responses, _ = parse_responses(bytes(data))
        for response in responses:
            check_response(run, response, case.raw)
        if case.answered and not responses and sock not in closed:
            run.fail("a complete faulty request left unanswered", case.raw)
        if sock not in closed:
            selector.unregister(sock)
        sock.close()


def assert_serving(server: RunningServer, run: Fuzzed, when: str) -> None:
    """The process lives and a valid request gets the right answer, over both protocols."""
    assert server.process.poll() is None, f"geserve died {when}:\n{server.log()[-3000:]}"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(http(b"POST", b"/v2/models/simple/infer", VALID_INFER))
        buffer = b""
        while not (responses := parse_responses(buffer)[0]):
            chunk = sock.recv(1 << 16)
            assert chunk, f"connection closed {when}"
            buffer += chunk
    (response,) = responses
    assert response.status == 200, (when, response.body)
    outputs = {o["name"]: o["data"] for o in json.loads(response.body)["outputs"]}
    assert outputs == {"OUTPUT0": (A + B).tolist(), "OUTPUT1": (A - B).tolist()}, when
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    response_deserializer=pb.ModelInferResponse.FromString)
        answer = infer(grpc_simple().SerializeToString(), timeout=READ_TIMEOUT_S)
    assert np.frombuffer(answer.raw_output_contents[0], np.int32).tolist() == (A + B).tolist(), when


def rss(server: RunningServer) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------------------------------ HTTP generators

TOKENS = [
    b'"', b"[", b"]", b"{", b"}", b",", b":", b"\\", b"\x00", b"\xff", b"\xc3\x28", b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80", b"-1", b"0", b"1e309", b"-0", b"99999999999999999999999", b"null", b"true", b"[]",
    b"{}", b"NaN", b'"\\ud800"', b"\r\n", b"%00", b"\x80",
]
SHAPES = [
    [2**62, 2**62], [2**63], [2**64], [2**200], [-1, 16], [1, -16], [0, 16], [1, 0], [8, 16], [9, 16], [1, 16, 1],
    [], [1.5, 16], ["1", 16], [True, 16], [2**31, 2**31, 2**31], [16], [1, 2**40], [None], [[1], 16],
]
DATATYPES = ["INT32", "INT64", "FP32", "FP16", "BYTES", "BOOL", "UINT8", "BF16", "int32", "", "FP8", "STRING", 5]
ENCODINGS = [b"gzip", b"deflate", b"br", b"x-gzip", b"GZIP", b"gzip, gzip", b"identity", b"gzip, identity",
             b"compress", b"", b"\xff"]


def mutate(rng: random.Random, data: bytes, rounds: int = 0) -> bytes:
    """Bit flips, byte swaps, inserted tokens, truncations, deletions and repeats."""
    out = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            index = min(at, len(out) - 1)
            out[index] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif op == 2:
            out[at:at] = rng.choice(TOKENS)
        elif op == 3:
            del out[at:]
        elif op == 4:
            del out[at:at + rng.randint(1, 16)]
        else:
            out[at:at] = out[at:at + rng.randint(1, 32)]
    return bytes(out)


_DEEP: list[tuple[int, object]] = []
_DEEP_TOKEN = re.compile(rb'"@@deep(\d+)@@"')


def nested(depth: int, leaf: object = 1) -> str:
    """A placeholder `dumps` writes as `leaf` inside `depth` arrays (json.dumps itself stops at ~1000 levels)."""
    _DEEP.append((depth, leaf))
    return f"@@deep{len(_DEEP) - 1}@@"


def dumps(value: object) -> bytes:
    def deep(match: re.Match[bytes]) -> bytes:
        depth, leaf = _DEEP[int(match.group(1))]
        return b"[" * depth + json.dumps(leaf).encode() + b"]" * depth

    return _DEEP_TOKEN.sub(deep, json.dumps(value).encode())


def json_input(rng: random.Random, name: str = "INPUT0") -> dict:
    tensor: dict = {"name": name, "shape": [1, 16], "datatype": "INT32", "data": A.tolist()}
    roll = rng.random()
    if roll < 0.3:
        tensor["shape"] = rng.choice(SHAPES)
    elif roll < 0.45:
        tensor["datatype"] = rng.choice(DATATYPES)
    elif roll < 0.55:
        tensor["data"] = nested(rng.choice([2, 50, 99, 101, 150, 1000, 1030]), rng.choice([1, "x", 1.5, None]))
    elif roll < 0.65:
        tensor["parameters"] = rng.choice([
            {"binary_data_size": rng.choice([-1, 0, 64, 2**64, "64", None])},
            {"shared_memory_region": rng.choice(["fz", "nope", 5, ""]), "shared_memory_byte_size":
             rng.choice([64, 0, -4, 2**64, 4096, 8192]), "shared_memory_offset": rng.choice([0, 64, -1, 4090])},
            nested(rng.choice([10, 120]), {"k": 1}),
        ])
    elif roll < 0.7:
        tensor["data"] = [rng.choice([2**31, -2**31 - 1, 2**64, 1e309, -0.0, True, "1"])] * 16
    elif roll < 0.75:
        del tensor[rng.choice(["name", "shape", "datatype", "data"])]
    return tensor


def json_infer(rng: random.Random) -> dict:
    request: dict = {"inputs": [json_input(rng, "INPUT0"), json_input(rng, "INPUT1")]}
    roll = rng.random()
    if roll < 0.2:
        name = rng.choice(["OUTPUT0", "OUTPUT1", "nope", ""])
        request["outputs"] = [{"name": name}, {"name": rng.choice([name, "OUTPUT1"])}]  # duplicates, often
    elif roll < 0.3:
        request["outputs"] = [{"name": "OUTPUT0", "parameters": {
            rng.choice(["classification", "binary_data", "shared_memory_region"]):
            rng.choice([0, -1, 2**70, "3", True, 3, "fz", None])}}]
    elif roll < 0.4:
        request["parameters"] = {rng.choice(["priority", "timeout", "binary_data_output", "sequence_id", "triton_x",
                                             "custom"]): rng.choice([-1, 2**64, "x", True, 1.5, None, {"a": 1}])}
    elif roll < 0.45:
        request["id"] = rng.choice([5, None, "\ud800", "x" * 5000, ["id"]])
    elif roll < 0.5:
        request["parameters"] = nested(rng.choice([101, 1200]), {"a": 1})
    return request


def binary_infer(rng: random.Random) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """tritonclient's binary form: a JSON header, then raw tensor bytes; lies in the sizes half of the time."""
    sizes = [64, 64]
    if rng.random() < 0.5:
        sizes = [rng.choice([0, 63, 64, 65, 128, 2**63]) for _ in sizes]
    inputs = [{"name": name, "shape": rng.choice([[1, 16], [1, 16], [2**62, 4], [1, -16]]), "datatype": "INT32",
               "parameters": {"binary_data_size": size}}
              for name, size in zip(("INPUT0", "INPUT1"), sizes, strict=True)]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": rng.random() < 0.5}}).encode()
    body = header + A.tobytes() + B.tobytes()
    length = str(len(header)).encode()
    if rng.random() < 0.4:
        length = rng.choice([b"-1", b"0", str(len(body) + 1).encode(), b"99999999999999999999", b"abc", b"",
                             str(len(header) - 3).encode(), b" 5", b"\xff"])
    return body, ((b"Inference-Header-Content-Length", length),)


def bytes_infer(rng: random.Random) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """identity_bytes with length-prefixed elements, the prefixes sometimes lying."""
    items = [b"hi", b"", b"\xff\xfe"]
    raw = b"".join(struct.pack("<I", len(v)) + v for v in items)
    if rng.random() < 0.6:
        raw = mutate(rng, raw)
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, rng.choice([3, 2, 4, 2**40])], "datatype":
                                     "BYTES", "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return header + raw, ((b"Inference-Header-Content-Length", str(len(header)).encode()),)


def encoded(rng: random.Random, body: bytes) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """The body under a Content-Encoding, right or wrong."""
    kind = rng.randrange(9)
    if kind == 0:
        return gzip.compress(body), ((b"Content-Encoding", b"gzip"),)
    if kind == 1:  # several gzip members, as a streaming client writes them
        cut = rng.randrange(len(body) + 1)
        return gzip.compress(body[:cut]) + gzip.compress(body[cut:]), ((b"Content-Encoding", b"gzip"),)
    if kind == 2:
        return zlib.compress(body), ((b"Content-Encoding", b"deflate"),)
    if kind == 3:
        return mutate(rng, gzip.compress(body)), ((b"Content-Encoding", b"gzip"),)
    if kind == 4:
        data = gzip.compress(body)
        return data[:rng.randrange(len(data))], ((b"Content-Encoding", b"gzip"),)
    if kind == 5:
        return gzip.compress(body) + rng.choice([b"\0\0\0", b"junk", gzip.compress(b"")]), (
            (b"Content-Encoding", b"gzip"),)
    if kind == 6:  # a bomb: past --http-max-input-size once inflated
        return gzip.compress(bytes(MAX_INPUT + 1024)), ((b"Content-Encoding", b"gzip"),)
    if kind == 7:
        return zlib.compress(gzip.compress(body)), ((b"Content-Encoding", b"gzip, deflate"),)
    return body, ((b"Content-Encoding", rng.choice(ENCODINGS)),)


PATHS = [
    b"/v2/models/simple/infer", b"/v2/models/simple/versions/1/infer", b"/v2/models/nobatch/infer",
    b"/v2/models/identity_bytes/infer", b"/v2/models/identity_fp16/infer", b"/v2/repository/index",
    b"/v2/repository/models/simple/load", b"/v2/repository/models/simple/unload",
    b"/v2/systemsharedmemory/region/fz2/register", b"/v2/systemsharedmemory/status",
    b"/v2/systemsharedmemory/region/fz2/unregister", b"/v2/cudasharedmemory/region/c/register",
    b"/v2/models/simple", b"/v2/models/simple/config", b"/v2/models/simple/stats", b"/v2/models/simple/ready",
    b"/v2/trace/setting", b"/v2", b"/v2/health/ready", b"/v2/models/simple/versions/99999999999999999999999/infer",
    b"/v2/models/%ff%fe/infer", b"/v2/models/" + b"x" * 3000 + b"/infer", b"/v2/models/simple/infer?x=%zz",
    b"/v2/models//infer", b"/v2/models/simple/versions/-1/infer", b"/v2/models/../simple/infer",
]


def pipelined_case(rng: random.Random, region_key: str) -> bytes:
    """One request whose framing is right (Content-Length tells its body) and whose content may be anything."""
    roll = rng.random()
    method, path = b"POST", b"/v2/models/simple/infer"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    if roll < 0.35:
        body = dumps(json_infer(rng))
        if rng.random() < 0.5:
            body = mutate(rng, body)
    elif roll < 0.5:
        body, headers = binary_infer(rng)
        if rng.random() < 0.3:
            body = mutate(rng, body)
    elif roll < 0.57:
        body, headers = bytes_infer(rng)
    elif roll < 0.7:
        body, headers = encoded(rng, VALID_INFER if rng.random() < 0.6 else dumps(json_infer(rng)))
    elif roll < 0.78:
        path = rng.choice(PATHS)
        method = rng.choice([b"POST", b"GET", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"])
        body = rng.choice([b"", b"{}", b'{"ready": "yes"}', b'{"ready": 1}', b'{"ready": true}', VALID_INFER,
                           json.dumps({"key": region_key, "byte_size": rng.choice([64, 0, -1, 2**64, 8192]),
                                       "offset": rng.choice([0, -1, 4095, 2**63])}).encode(),
                           json.dumps({"key": rng.choice(["/nope", "..", "/a/b", "\x00", "", 5]),
                                       "byte_size": 8}).encode(),
                           json.dumps({"parameters": {"config": "{bad"}}).encode(),
                           json.dumps({"trace_rate": "x", "trace_level": ["OFF"]}).encode(),
                           b"[" * 150 + b"]" * 150, b"\xff\xfe{}"])
        if rng.random() < 0.4:
            body = mutate(rng, body)
    elif roll < 0.86:  # headers: odd but well formed
        body = VALID_INFER
        name = rng.choice([b"Content-Type", b"Accept-Encoding", b"Expect", b"X-Fuzz", b"Authorization",
                           b"Inference-Header-Content-Length", b"Triton-Grpc-Error"])
        value = rng.choice([b"gzip", b"deflate;q=0, gzip;q=0.5", b"100-continue", b"\x80\xff", b"", b"x" * 2000,
                            b"application/octet-stream", b"*", b"0", b"-5"])
        headers = ((name, value),)
    else:  # raw binary bodies (header length 0) of any size
        path = rng.choice([b"/v2/models/simple/infer", b"/v2/models/identity_bytes/infer",
                           b"/v2/models/identity_fp16/infer", b"/v2/models/nobatch/infer"])
        body = rng.randbytes(rng.choice([0, 1, 3, 8, 24, 64, 65, 1000]))
        headers = ((b"Inference-Header-Content-Length", b"0"),)
    return http(method, path, body, headers)


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        piece = body[at:at + size]
        out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        at += size
    rest = body[at:]
    if rest:
        out += f"{len(rest):x}\r\n".encode() + rest + b"\r\n"
    return out + b"0\r\n\r\n"


def framing_case(rng: random.Random) -> Framing:
    body = VALID_INFER
    head = b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    kind = rng.randrange(12)
    if kind == 0:  # Content-Length shorter than the body: the rest reads as a request line
        return Framing(head + f"Content-Length: {rng.randrange(len(body))}\r\n\r\n".encode() + body, answered=False)
    if kind == 1:  # longer than the body, then the client gives up
        return Framing(head + f"Content-Length: {len(body) + rng.randint(1, 1000)}\r\n\r\n".encode() + body,
                       answered=False, hang_up=True)
    if kind == 2:
        value = rng.choice([b"abc", b"-5", b"1 2", b"0x10", b"99999999999999999999999", b"\xff"])
        return Framing(head + b"Content-Length: " + value + b"\r\n\r\n" + body, answered=False)
    if kind == 3:  # both framings
        return Framing(head + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
                       + chunked(body, [50]), answered=True)
    if kind == 4:  # bad chunk sizes and chunk syntax
        bad = rng.choice([b"zz\r\n", b"-1\r\n", b"ffffffffffffffffffff\r\n", b"5\r\nab", b"3;\xff\r\nabc\r\n",
                          b"3\r\nabcXY", b"\r\n\r\n"])
        return Framing(head + b"Transfer-Encoding: chunked\r\n\r\n" + bad + b"0\r\n\r\n", answered=False)
    if kind == 5:  # well-formed chunking, valid or gzip'd member by member (a streaming client's body)
        sizes = [rng.randint(1, 80) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.5:
            return Framing(head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes), answered=True)
        members, at = [], 0
        for size in sizes:
            members.append(gzip.compress(body[at:at + size]))
            at += size
        members.append(gzip.compress(body[at:]))
        payload = b"".join(f"{len(m):x}\r\n".encode() + m + b"\r\n" for m in members) + b"0\r\n\r\n"
        return Framing(head + b"Transfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n" + payload,
                       answered=True)
    if kind == 6:  # transfer codings other than chunked
        coding = rng.choice([b"gzip, chunked", b"deflate, chunked", b"br, chunked", b"chunked, chunked", b"gzip"])
        data = gzip.compress(body) if coding.startswith(b"gzip") else zlib.compress(body)
        return Framing(head + b"Transfer-Encoding: " + coding + b"\r\n\r\n" + chunked(data, [30]), answered=False)
    if kind == 7:  # the request head itself mutated
        raw = head + f"Content-Length: {len(body)}\r\n\r\n".encode()
        return Framing(mutate(rng, raw) + body, answered=False)
    if kind == 8:  # garbage, HTTP/2 preface, HTTP/1.0, an upgrade
        return Framing(rng.choice([rng.randbytes(rng.randint(1, 200)) + b"\r\n\r\n",
                                   b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                                   b"GET /v2/health/ready HTTP/1.0\r\n\r\n",
                                   b"GET /v2 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                                   b"GET /v2 HTTP/9.9\r\n\r\n", b"\r\n\r\n\r\n"]), answered=False)
    if kind == 9:  # headers past the limits (431), or many of them
        many = b"".join(b"X-%d: y\r\n" % i for i in range(rng.choice([150, 2000])))
        huge = b"X-Big: " + b"a" * rng.choice([70_000, 200_000]) + b"\r\n"
        return Framing(head + rng.choice([many, huge]) + b"Content-Length: 0\r\n\r\n", answered=False)
    if kind == 10:  # a body declared past --http-max-input-size: refused before it is read
        return Framing(head + f"Content-Length: {MAX_INPUT + 1}\r\n\r\n".encode() + body, answered=True)
    # header syntax faults: no colon, a NUL, an obsolete line fold, a space before the colon
    bad = rng.choice([b"NoColon\r\n", b"X-A: a\x00b\r\n", b"X-A: a\r\n  folded\r\n", b"X-A : a\r\n", b": empty\r\n"])
    return Framing(head + bad + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, answered=False)


# ------------------------------------------------------------------------------------------ gRPC generators

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
RPCS = [m.name for m in SERVICE.methods]
NAMES = ["simple", "nope", "", "identity_bytes", "\x00", "a" * 300, "simple/../x"]
VERSIONS = ["", "1", "abc", "99999999999999999999", "-1", "0"]


def grpc_simple() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="simple")
    for name, data in (("INPUT0", A), ("INPUT1", B)):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(data.tobytes())
    return request


def grpc_infer(rng: random.Random) -> pb.ModelInferRequest:
    request = grpc_simple()
    roll = rng.random()
    tensor = request.inputs[rng.randrange(2)]
    if roll < 0.25:
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[2**62, 2**62], [2**63 - 1, 2], [-1, 16], [1, -16], [0, 16], [8, 16], [],
                                        [1, 16, 1], [-2**63, -1]]))
    elif roll < 0.35:
        tensor.datatype = rng.choice(["BYTES", "FP16", "BF16", "", "INT64", "int32", "\x00"])
    elif roll < 0.45:
        del request.raw_input_contents[:]
        tensor.contents.int_contents.extend(rng.choice([[1] * 16, [1] * 3, []]))
        tensor.contents.bytes_contents.extend(rng.choice([[], [b"x"]]))
    elif roll < 0.55:
        name = rng.choice(["OUTPUT0", "OUTPUT1", "nope"])
        request.outputs.add(name=name)
        request.outputs.add(name=rng.choice([name, "OUTPUT1"]))
    elif roll < 0.65:
        key = rng.choice(["priority", "timeout", "custom", "triton_enable_empty_final_response", "sequence_id"])
        kind, value = rng.choice([("int64_param", -1), ("int64_param", 2**62), ("string_param", "x"),
                                  ("bool_param", True), ("uint64_param", 2**64 - 1), ("double_param", 1.5)])
        setattr(request.parameters[key], kind, value)
    elif roll < 0.75:
        tensor.parameters["shared_memory_region"].string_param = rng.choice(["fz", "nope", ""])
        tensor.parameters["shared_memory_byte_size"].int64_param = rng.choice([64, 0, -1, 2**62, 4096])
        tensor.parameters["shared_memory_offset"].int64_param = rng.choice([0, -64, 4090, 2**62])
    elif roll < 0.85:
        request.raw_input_contents[rng.randrange(2)] = rng.randbytes(rng.choice([0, 3, 63, 65, 128]))
    elif roll < 0.9:
        request.model_name, request.model_version = rng.choice(NAMES), rng.choice(VERSIONS)
    return request


def grpc_message(rng: random.Random, rpc: str, region_key: str) -> bytes:
    """A well-formed message of the RPC's request type with odd field values."""
    name, version = rng.choice(NAMES), rng.choice(VERSIONS)
    builders: dict[str, Callable[[], object]] = {
        "ServerLive": pb.ServerLiveRequest, "ServerReady": pb.ServerReadyRequest,
        "ServerMetadata": pb.ServerMetadataRequest,
        "ModelReady": lambda: pb.ModelReadyRequest(name=name, version=version),
        "ModelMetadata": lambda: pb.ModelMetadataRequest(name=name, version=version),
        "ModelConfig": lambda: pb.ModelConfigRequest(name=name, version=version),
        "ModelStatistics": lambda: pb.ModelStatisticsRequest(name=name, version=version),
        "ModelInfer": lambda: grpc_infer(rng), "ModelStreamInfer": lambda: grpc_infer(rng),
        "RepositoryIndex": lambda: pb.RepositoryIndexRequest(ready=rng.random() < 0.5,
                                                             repository_name=rng.choice(["", "r"])),
        "RepositoryModelLoad": lambda: pb.RepositoryModelLoadRequest(model_name=name),
        "RepositoryModelUnload": lambda: pb.RepositoryModelUnloadRequest(model_name=name),
        "SystemSharedMemoryStatus": lambda: pb.SystemSharedMemoryStatusRequest(name=rng.choice(["", "fz", "x"])),
        "SystemSharedMemoryRegister": lambda: pb.SystemSharedMemoryRegisterRequest(
            name=rng.choice(["g1", "g2", "fz"]), key=rng.choice([region_key, "/nope", "..", "", "/a/b"]),
            offset=rng.choice([0, 64, 4095, 2**63]), byte_size=rng.choice([0, 64, 4096, 8192, 2**64 - 1])),
        "SystemSharedMemoryUnregister": lambda: pb.SystemSharedMemoryUnregisterRequest(name=rng.choice(["g1", "x"])),
        "CudaSharedMemoryStatus": lambda: pb.CudaSharedMemoryStatusRequest(name=rng.choice(["", "c"])),
        "CudaSharedMemoryRegister": lambda: pb.CudaSharedMemoryRegisterRequest(
            name="c", raw_handle=rng.randbytes(8), device_id=rng.choice([0, -1, 2**62]), byte_size=8),
        "CudaSharedMemoryUnregister": lambda: pb.CudaSharedMemoryUnregisterRequest(name=rng.choice(["", "c"])),
        "TraceSetting": lambda: pb.TraceSettingRequest(model_name=rng.choice(["", "simple", "nope"])),
        # no settings: a fuzzed verbose level would only slow the rest of the run down
        "LogSettings": pb.LogSettingsRequest,
    }
    message = builders[rpc]()
    if rpc == "TraceSetting" and rng.random() < 0.5:
        message.settings[rng.choice(["trace_rate", "trace_level", "x", "trace_count"])].value.append(  # type: ignore[attr-defined]
            rng.choice(["1", "OFF", "TIMESTAMPS", "x", "-5", ""]))
    return message.SerializeToString()  # type: ignore[attr-defined]


def grpc_payload(rng: random.Random, rpc: str, region_key: str) -> bytes:
    roll = rng.random()
    if roll < 0.25:
        return rng.randbytes(rng.randint(0, 64))
    if roll < 0.45:
        return grpc_message(rng, rpc, region_key)
    if roll < 0.9:
        return mutate(rng, grpc_message(rng, rpc, region_key))
    return grpc_message(rng, rng.choice(RPCS), region_key)  # another RPC's message


def grpc_code(run: Fuzzed, code: grpc.StatusCode, details: str, rpc: str, payload: bytes) -> None:
    run.statuses[f"grpc {code.name}"] += 1
    if code in GRPC_DEFINITE or (code == grpc.StatusCode.INTERNAL and details.startswith(DELIBERATE_500)):
        return
    run.fail(f"gRPC {rpc} {code.name} {details[:200]!r}", payload)


def fuzz_grpc(server: RunningServer, rng: random.Random, region_key: str, run: Fuzzed, calls: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        unary = {rpc: channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}") for rpc in RPCS
                 if rpc != "ModelStreamInfer"}
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        done = 0
        while done < calls:
            futures = []
            for _ in range(50):
                rpc = rng.choice(RPCS)
                if rpc == "ModelStreamInfer":
                    messages = [grpc_payload(rng, rpc, region_key) for _ in range(rng.randint(1, 8))]
                    strict = rng.random() < 0.3
                    metadata = (("triton_grpc_error", "true"),) if strict else ()
                    try:
                        answers = list(stream(iter(messages), timeout=READ_TIMEOUT_S, metadata=metadata))
                        for answer in answers:
                            reply = pb.ModelStreamInferResponse.FromString(answer)
                            if reply.error_message.startswith("internal error"):
                                run.fail(f"stream {reply.error_message[:200]!r}", b"".join(messages))
                        grpc_code(run, grpc.StatusCode.OK, "", rpc, b"".join(messages))
                    except grpc.RpcError as exc:
                        grpc_code(run, exc.code(), exc.details() or "", rpc, b"".join(messages))
                    done += len(messages)
                    continue
                payload = grpc_payload(rng, rpc, region_key)
                futures.append((rpc, payload, unary[rpc].future(payload, timeout=READ_TIMEOUT_S)))
            for rpc, payload, future in futures:
                try:
                    future.result()
                    grpc_code(run, grpc.StatusCode.OK, "", rpc, payload)
                except grpc.RpcError as exc:
                    grpc_code(run, exc.code(), exc.details() or "", rpc, payload)
            done += len(futures)
        health = channel.unary_unary("/grpc.health.v1.Health/Check")
        for _ in range(20):
            payload = rng.randbytes(rng.randint(1, 16))
            try:
                health(payload, timeout=READ_TIMEOUT_S)
                grpc_code(run, grpc.StatusCode.OK, "", "Health", payload)
            except grpc.RpcError as exc:
                grpc_code(run, exc.code(), exc.details() or "", "Health", payload)
        run.requests += calls + 20


# ----------------------------------------------------------------------------------------------------- test


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def test_fuzzed_http_and_grpc_leave_the_server_serving(server: RunningServer, region: Region) -> None:
    print(f"fuzz seed: {SEED} (GESERVE_FUZZ_SEED={SEED} reruns it)")
    rng = random.Random(SEED)
    _raise_fd_limit(HTTP_FRAMING + 256)
    started = time.monotonic()
    run = Fuzzed()
    # Warm up every path once (ORT arenas, first compressions), then take the memory baseline.
    pipeline(server.http_port, [pipelined_case(random.Random(i), region.key) for i in range(200)], Fuzzed())
    fuzz_grpc(server, random.Random(0), region.key, Fuzzed(), 100)
    assert_serving(server, run, "after the warm-up")
    baseline = rss(server)

    cases = [pipelined_case(rng, region.key) for _ in range(HTTP_PIPELINED)]
    for start in range(0, len(cases), 400):
        pipeline(server.http_port, cases[start:start + 400], run)
        assert_serving(server, run, f"after pipelined HTTP case {start + 400}")
    exchange_framing(server.http_port, [framing_case(rng) for _ in range(HTTP_FRAMING)], run)
    assert_serving(server, run, "after the framing faults")
    for start in range(0, GRPC_CALLS, 300):
        fuzz_grpc(server, rng, region.key, run, 300)
        assert_serving(server, run, f"after gRPC call {start + 300}")

    growth = rss(server) - baseline
    elapsed = time.monotonic() - started
    print(f"{run.requests} requests in {elapsed:.1f} s; RSS {baseline / 2**20:.0f} MiB, growth "
          f"{growth / 2**20:+.1f} MiB; {dict(sorted(run.statuses.items()))}")
    assert not run.failures, f"seed {SEED}: {len(run.failures)} failures:\n" + "\n".join(run.failures[:20])
    assert run.requests >= HTTP_PIPELINED + HTTP_FRAMING + GRPC_CALLS
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB"
    assert "Traceback" not in server.log(), server.log()[-4000:]


# ------------------------------------------------------------------- pinned: what issue 12 asks, end to end
# The same process the fuzzer uses (cheap: it is already up), each answer stated exactly.


def _exchange(server: RunningServer, raw: bytes) -> Response:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=READ_TIMEOUT_S) as sock:
        sock.sendall(raw)
        buffer = b""
        while not (responses := parse_responses(buffer)[0]):
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed without an answer: {buffer!r}"
            buffer += chunk
    return responses[0]


def _error(response: Response) -> str:
    message = json.loads(response.body)["error"]
    assert isinstance(message, str)
    return message


def _refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details() or ""


def test_every_grpc_rpc_answers_bytes_that_do_not_parse_invalid_argument(server: RunningServer) -> None:
    """Triton 2.51 answers these INTERNAL "Unable to parse request" (gRPC's own text); geserve INVALID_ARGUMENT with
    the same words: the client sent them, so the status says so. Before, grpc.aio answered UNKNOWN."""
    garbage = b"\xff\xff\xff"
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        for rpc in RPCS:
            if rpc == "ModelStreamInfer":
                continue
            unary = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
            assert _refusal(lambda: unary(garbage, timeout=READ_TIMEOUT_S)) == (  # noqa: B023 - called at once
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Unable to parse request: Error parsing message with type 'inference.{rpc}Request': "
                "Wire format was corrupt",
            ), rpc
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        for call in (lambda: check(garbage, timeout=READ_TIMEOUT_S),
                     lambda: list(watch(garbage, timeout=READ_TIMEOUT_S))):
            assert _refusal(call)[0] == grpc.StatusCode.INVALID_ARGUMENT
        # A stream answers the message in band, like any refused request, and goes on to the next one.
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)
        first, second = stream(iter([garbage, grpc_simple().SerializeToString()]), timeout=READ_TIMEOUT_S)
        assert first.error_message.startswith("Unable to parse request: ") and not second.error_message
        assert np.frombuffer(second.infer_response.raw_output_contents[0], np.int32).tolist() == (A + B).tolist()
        strict = (("triton_grpc_error", "true"),)  # ...or, asked to end on the first failure, ends with it
        code, _ = _refusal(lambda: list(stream(iter([garbage]), timeout=READ_TIMEOUT_S, metadata=strict)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_output_named_twice_is_refused_on_both_protocols(server: RunningServer) -> None:
    """Newer Triton refuses it (2.51 answered it once); the rule is the service's, once for both protocols."""
    expected = "[request id: <id_unknown>] output 'OUTPUT0' already exists in request"
    body = json.dumps({**json.loads(VALID_INFER), "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}]}).encode()
    response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", body))
    assert (response.status, _error(response)) == (400, expected)
    request = grpc_simple()
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT0")
    assert _grpc_infer_refusal(server, request) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def _grpc_infer_refusal(server: RunningServer, request: pb.ModelInferRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        return _refusal(lambda: infer(request.SerializeToString(), timeout=READ_TIMEOUT_S))


def test_a_shape_past_int64_elements_is_refused_on_both_protocols(server: RunningServer) -> None:
    expected = f"input 'INPUT0' with shape [16,{2**60 + 2}] causes total element count to exceed maximum size of " \
               f"{2**63 - 1}"
    body = json.loads(VALID_INFER)
    body["inputs"][0]["shape"] = [16, 2**60 + 2]
    response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", json.dumps(body).encode()))
    assert (response.status, _error(response)) == (400, expected)
    request = grpc_simple()
    request.inputs[0].shape[:] = [16, 2**60 + 2]
    assert _grpc_infer_refusal(server, request) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def test_a_shape_past_int64_bytes_is_refused_on_both_protocols(server: RunningServer) -> None:
    """Triton's qa test_buffer_size_overflow: fewer than 2**63 elements of 4 bytes, more than 2**63 bytes. Not compared
    side by side: the reference Triton 2.51 drops the connection on it (the overflow newer Triton refuses)."""
    expected = "byte size overflow for input 'INPUT0'"
    body = json.loads(VALID_INFER)
    body["inputs"][0]["shape"] = [4, 2**60 + 2]
    response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", json.dumps(body).encode()))
    assert (response.status, _error(response)) == (400, expected)
    request = grpc_simple()
    request.inputs[0].shape[:] = [4, 2**60 + 2]
    assert _grpc_infer_refusal(server, request) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def test_a_repository_index_ready_of_the_wrong_type_is_refused_before_the_nesting_depth(server: RunningServer) -> None:
    """Triton's qa test_repository_index_deeply_nested_json: `ready` first (Triton limits depth where it reads
    inference data); a body nested too deeply whose `ready` is a boolean still meets geserve's depth limit."""
    for options in ({"ready": nested(150)}, {"x": nested(150), "ready": 1}):
        response = _exchange(server, http(b"POST", b"/v2/repository/index", dumps(options)))
        assert (response.status, _error(response)) == (400, "Invalid value for 'ready': expected a boolean")
    response = _exchange(server, http(b"POST", b"/v2/repository/index", dumps({"ready": True, "x": nested(150)})))
    assert (response.status, _error(response)) == (400, "JSON nesting depth exceeds maximum allowed limit (100)")


def test_tritons_newer_http_texts(server: RunningServer) -> None:
    """Triton answers these 500 (a client's malformed JSON); geserve 400, in Triton's words."""
    body = json.loads(VALID_INFER)
    body["inputs"][0]["data"] = nested(120)
    response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", dumps(body)))
    assert (response.status, _error(response)) == (400, "JSON nesting depth exceeds maximum allowed limit (100)")
    for ready in (b'"yes"', b"1", b"null"):
        response = _exchange(server, http(b"POST", b"/v2/repository/index", b'{"ready": ' + ready + b"}"))
        assert (response.status, _error(response)) == (400, "Invalid value for 'ready': expected a boolean")


def _chunked_request(payload: bytes, headers: bytes) -> bytes:
    return (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n" + headers
            + b"\r\n" + payload)


def test_a_chunked_body_gzipped_as_it_streams_is_decoded(server: RunningServer) -> None:
    """Issue 12's 400: a client that gzips each piece as it sends it chunked writes one gzip member per piece, and
    only the first member used to be decoded. Every member is now, and a gzip transfer coding is undone too."""
    pieces = [VALID_INFER[at:at + 40] for at in range(0, len(VALID_INFER), 40)]
    members = [gzip.compress(piece) for piece in pieces]
    payload = b"".join(f"{len(m):x}\r\n".encode() + m + b"\r\n" for m in members) + b"0\r\n\r\n"
    for headers in (b"Content-Encoding: gzip\r\n", b"Content-Encoding: gzip\r\nAccept-Encoding: identity\r\n"):
        response = _exchange(server, _chunked_request(payload, headers))
        assert response.status == 200, response.body
        outputs = {o["name"]: o["data"] for o in json.loads(response.body)["outputs"]}
        assert outputs["OUTPUT0"] == (A + B).tolist()
    one = gzip.compress(VALID_INFER)
    transfer = (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip, chunked\r\n"
                b"\r\n" + f"{len(one):x}\r\n".encode() + one + b"\r\n0\r\n\r\n")
    assert _exchange(server, transfer).status == 200
    # As in Triton 2.51 and before: a trailer cut short, or data after the end that is no gzip member, leaves the
    # decoded JSON to be judged by the parse (here it is whole)...
    for body in (one[:-5], one + b"junk", one + bytes(16)):
        response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", body, ((b"Content-Encoding", b"gzip"),)))
        assert response.status == 200, response.body
    # ...while a member that follows must be whole.
    response = _exchange(server, http(b"POST", b"/v2/models/simple/infer", one + one[:3] + b"\xff" * 8,
                                      ((b"Content-Encoding", b"gzip"),)))
    assert (response.status, _error(response)) == (
        400, "failed to decompress the gzip request body: Error -3 while decompressing data: unknown header flags set")
